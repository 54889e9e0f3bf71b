"""The evaluation's plots: every label readable (no two texts of a figure overlap)."""

import matplotlib

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

from hf_kvcompress.eval.report import MiB, plot_quality_vs_memory


def overlapping_texts(monkeypatch, draw) -> list[tuple[str, str]]:
    """Run `draw()` and return the pairs of drawn texts (labels, ticks, legend entries) whose boxes overlap."""
    figures = []
    save = Figure.savefig

    def keep(figure, *args, **kwargs):
        figures.append(figure)
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    draw()
    (figure,) = figures
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in figure.findobj(Text)
             if t.get_visible() and t.get_text().strip()]  # fmt: skip
    return [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1 :] if box.overlaps(other)]


def test_quality_vs_memory_names_methods_of_the_same_memory_and_score_apart(monkeypatch, tmp_path):
    # docs/results.md's first eval table: h2o and sink_window at a budget of 256 sit on one point.
    rows = [("dynamic", 100, 44.3), ("int4", 83.3, 12.4), ("h2o:budget=256", 33.3, 11.3),
            ("sink_window:window=256", 33.3, 11.4)]  # fmt: skip
    summary = {"ranking": [{"method": m, "score": s, "kv_bytes_peak": b * MiB} for m, s, b in rows], "rows": [],
               "methods": [m for m, *_ in rows]}
    assert overlapping_texts(monkeypatch, lambda: plot_quality_vs_memory(summary, tmp_path)) == []
