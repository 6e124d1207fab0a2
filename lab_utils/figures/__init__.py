"""The figures of the notebooks, one module per notebook (named as its
experiment module, `lab_utils.experiments.<name>`), each importing only the
shared package. The experiment module re-exports them, so a notebook calls
`<module>.plot_...` as before; each function returns a matplotlib Figure (or
None, printed, when there is nothing to draw) with a title, labelled axes and
a legend, in the lab's theme (`lab_utils.plots`)."""


def pyplot():
    """matplotlib's pyplot and seaborn, with the lab's theme applied (importing
    `lab_utils.plots` sets it): imported when a figure is drawn, not before."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    from .. import plots  # noqa: F401  (the lab's figure theme)
    return plt, sns


def titled(fig, title: str, **layout):
    """`fig` with its title and a tight layout (`layout`: tight_layout's
    arguments), returned for the notebook to show."""
    fig.suptitle(title)
    fig.tight_layout(**layout)
    return fig

