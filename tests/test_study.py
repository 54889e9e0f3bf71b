"""The study's note on the int codecs' full-precision residual, which decides their bytes at short lengths."""

from hf_kvcompress.study import residual_note


def test_a_window_inside_the_residual_is_said_to_quantize_nothing():
    note = residual_note("sink_window:sink_tokens=4,window=121+int4", 500)
    assert note.startswith("sink_window:sink_tokens=4,window=121+int4: keeps 125 tokens per layer, all within int4's")
    assert "nothing is quantized" in note


def test_longer_kept_spans_say_how_much_stays_full_precision():
    assert "the 128 most recent of 1000 kept tokens stay in full precision" in residual_note("int4", 1000)
    assert "the 64 most recent of 300 kept tokens" in residual_note("int2:residual_length=64", 300)
    assert "nothing is quantized" in residual_note("int8", 100)


def test_plans_without_an_int_codec_have_no_note():
    assert residual_note("dynamic", 1000) is None
    assert residual_note("fp8", 1000) is None
    assert residual_note("sink_window:window=64", 1000) is None
    assert residual_note("int4:residual_length=0", 1000) is None


def test_per_head_budgets_keep_the_residual_like_every_other_plan():
    # A head-budget KVzip layer keeps the prompt's kept pairs within the residual in full precision, as the others do.
    assert "the 128 most recent of 250 kept" in residual_note("kvzip:ratio=0.25+int4", 1000)
    assert "the 128 most recent of 250 kept" in residual_note("kvzip:ratio=0.25,budgets=uniform+int4", 1000)
    assert "nothing is quantized" in residual_note("kvzip:ratio=0.25+int4", 100)


def test_the_study_plots_log_axis_labels_do_not_overlap(monkeypatch, tmp_path):
    """Less than a decade of bytes: matplotlib's own labels (2x10^0, 3x10^0, 4x10^0...) ran into each other."""
    from hf_kvcompress.study import PlanResult, plot_study
    from tests.eval.test_report import overlapping_texts

    def plan(spec, mib):
        return PlanResult(spec=spec, formula_bytes=0, measured_bytes=mib * 2**20, factor=1, bands={}, score=100,
                          delta=0, bytes_per_user=0, users=0, band_ci={"all": (21, 100)})

    for spread in ([7.91, 4.62, 0.71, 2.23], [95.7, 31.7, 20.8, 8.4], [30.1, 24.7, 20.8]):
        results = [plan(spec, mib) for spec, mib in zip(("dynamic", "int8", "int4", "fp8"), spread, strict=False)]
        assert overlapping_texts(monkeypatch, lambda results=results: plot_study(results, tmp_path)) == [], spread
        monkeypatch.undo()


def test_a_ratio_the_plan_runs_as_a_byte_target_has_no_residual_note():
    """On a model without sliding layers `kvzip:ratio=0.25+int4` is planned as its int4 pairs' byte target (32 exact
    newest tokens paid for inside the target, not int4's 128): the note read from the typed spec would be wrong.
    On a hybrid model the ratio keeps its own plan, and its note."""
    from tests.caches.tiny_models import tiny_hybrid_gemma, tiny_model

    assert residual_note("kvzip:ratio=0.25+int4", 1000, tiny_model("llama").config) is None
    assert residual_note("kvzip:bytes=0.1+int4", 1000) is None
    assert "the 128 most recent of 250 kept" in residual_note("kvzip:ratio=0.25+int4", 1000,
                                                              tiny_hybrid_gemma().config)
    assert "the 128 most recent of 1000 kept" in residual_note("int4", 1000, tiny_model("llama").config)
