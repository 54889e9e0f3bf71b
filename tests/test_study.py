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


def test_per_head_budgets_say_the_whole_kept_prompt_is_encoded():
    # A head-budget KVzip layer encodes every kept pair of the prompt; only later tokens wait in full precision.
    note = residual_note("kvzip:ratio=0.25+int4", 1000)
    assert "every kept pair of the compressed prompt is stored in int4" in note and "most recent" not in note
    assert "the 128 most recent of 250 kept" in residual_note("kvzip:ratio=0.25,budgets=uniform+int4", 1000)
