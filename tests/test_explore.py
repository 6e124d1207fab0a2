"""`lab.explore` without a browser (tests/test_browser.py drives it in one):
Run calls the function with the widgets' values and, with `plot`, draws the
figure of what it returned beside the table; `plots.table_figure` on
hand-made tables."""
from __future__ import annotations

import ipywidgets as w
import matplotlib
import pandas as pd
import pytest

from lab_utils.notebook import explore
from lab_utils.plots import table_figure

matplotlib.use("Agg")


def _run(box) -> None:
    next(c for c in box.children if isinstance(c, w.Button)).click()


def test_run_passes_the_widget_values_and_plots_the_result():
    seen, plotted = [], []
    table = pd.DataFrame({"ttft_ms": [10.0, 30.0]}, index=pd.Index([128, 1024], name="prompt"))

    def function(n, fixed):
        seen.append((n, fixed))
        return table

    box = explore(function, plot=lambda t: plotted.append(t) or None,
                  n=w.IntSlider(value=3), fixed="x")
    assert seen == [] and plotted == []  # nothing runs before Run
    box.children[0].value = 5
    _run(box)
    assert seen == [(5, "x")] and plotted[0] is table
    assert isinstance(box.children[-1], w.HBox)  # table and figure side by side


def test_without_plot_or_result_nothing_is_drawn():
    box = explore(lambda: None, plot=lambda t: pytest.fail("no result: no plot"))
    _run(box)
    assert isinstance(explore(lambda: 1).children[-1], w.Output)


def test_table_figure_bars_per_row_and_lines_on_a_numeric_index():
    arms = pd.DataFrame({"TTFT p50 (ms)": [5.0, 7.0, 9.0], "TTFT p99 (ms)": [8.0, 9.0, 20.0],
                         "HTTP": ["h1", "h2", "h2"]}, index=["a", "b", "c"])
    fig = table_figure(arms, ["TTFT p50 (ms)", "TTFT p99 (ms)", "not there"], ylabel="ms")
    ax = fig.axes[0]
    assert len(ax.patches) == 6  # 3 rows x 2 columns that exist
    assert sorted(p.get_height() for p in ax.patches) == [5.0, 7.0, 8.0, 9.0, 9.0, 20.0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    assert ax.get_ylabel() == "ms"
    lengths = pd.DataFrame({"50%": [10.0, 40.0]}, index=pd.Index([128, 1024], name="prompt"))
    line = table_figure(lengths, ["50%"], ylabel="TTFT (ms)", kind="line").axes[0].lines[0]
    assert list(line.get_xdata()) == [128, 1024] and list(line.get_ydata()) == [10.0, 40.0]
    assert table_figure(arms, ["HTTP"], ylabel="x") is None  # no number to draw
    assert table_figure(arms.iloc[:0], ["TTFT p50 (ms)"], ylabel="x") is None
