"""The figures package's shared helpers."""
import matplotlib

matplotlib.use("Agg")


def test_titled_sets_the_title_and_returns_the_figure():
    import matplotlib.pyplot as plt

    from lab_utils.figures import titled
    fig, ax = plt.subplots()
    assert titled(fig, "TTFT per arm") is fig
    assert fig._suptitle.get_text() == "TTFT per arm"
    plt.close(fig)


def test_every_figure_module_imports_and_uses_the_shared_theme():
    import importlib
    import pkgutil

    import lab_utils.figures as figures
    names = [m.name for m in pkgutil.iter_modules(figures.__path__)]
    assert {"chunked_prefill", "priority_scheduling", "streaming"} <= set(names)
    for name in names:
        module = importlib.import_module(f"lab_utils.figures.{name}")
        assert module.__doc__ and f"`lab_utils.experiments.{name}`" in module.__doc__.replace("\n", " ")
