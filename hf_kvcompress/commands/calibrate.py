"""`hf-kvcompress calibrate`: fit the low-rank codec's PCA bases on calibration text and report what they keep;
with `--probe`, KVzap's score probes (probe_calibration.py) and their fit; with `--sharing`, the head-sharing maps of
shared_heads:ratio (calibration.calibrate_sharing); with `--key-scales`, the int codecs' key channel scales
(key_scale); with `--floors`, KVzip's per-layer floors on a hybrid model (floor_calibration.py)."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit PCA bases of keys and values for the lowrank codec",
        description=__doc__ + " The bases are written to OUT/lowrank_bases.safetensors (the model's name and shapes "
        "in its metadata: other models refuse it); a cache uses them as lowrank:bases=OUT (without `bases`, "
        "lowrank reads the bases shipped for the embedded models). By default one basis per layer and kind over "
        "the layer's KV heads, keys with RoPE undone (`--heads each`: one per KV head, keys after RoPE). The "
        "report: the share of each layer's key and value variance kept at a quarter and a half of the dimensions.")
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="directory for lowrank_bases.safetensors (required)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="calibration tokens (default: %(default)s; with --probe: tokens per document, 1024)")
    parser.add_argument("--heads", choices=("joint", "each"), default="joint",
                        help="one basis over a layer's KV heads, keys pre-RoPE (joint, default), or one per KV head, "
                        "keys post-RoPE (each)")
    parser.add_argument("--probe", action="store_true",
                        help="fit KVzap's score probes instead (kvzap policy): OUT/kvzap_probe.safetensors, or OUT "
                        "itself when it ends in .safetensors; a cache uses them as kvzap:probe=OUT")
    parser.add_argument("--sharing", action="store_true",
                        help="measure which KV heads of each layer the others predict (least squares, keys pre-RoPE) "
                        "and fit the maps instead (shared_heads:ratio), then each level's copy cost (the rise of the "
                        "loss on a second reading of 512 held-out tokens with only that level predicted, what a ratio "
                        "spends by): OUT/shared_heads.safetensors; a cache uses them as shared_heads:ratio=R,maps=OUT")
    parser.add_argument("--key-scales", action="store_true",
                        help="write each layer's key channel scales instead (int codecs' key_scale, for keys grouped "
                        "per token under eviction): OUT/key_scales.safetensors; a cache uses them as "
                        "int4:key_scale=OUT")
    parser.add_argument("--floors", action="store_true",
                        help="fit KVzip's per-layer floors instead (a plain kvzip ratio on a model with sliding-window "
                        "layers): the share of the document each full-attention layer keeps at least, chosen per "
                        "ratio by the facts a compressed calibration document still answers: "
                        "OUT/layer_floors.safetensors, or OUT itself when it ends in .safetensors; a cache uses them "
                        "as kvzip:ratio=R,floors=OUT")
    parser.add_argument("--ratios", default="0.25,0.125",
                        help="with --floors: the ratios to fit floors at, comma-separated (default: %(default)s); "
                        "a ratio between them takes the nearest's floors")
    parser.add_argument("--stat", choices=("absmax", "rms", "p99"), default="absmax",
                        help="with --key-scales: each channel's scale, the largest magnitude over the calibration "
                        "tokens (absmax, default), their root mean square (rms) or 99th percentile (p99)")
    parser.add_argument("--documents", type=int, default=12,
                        help="with --probe: calibration documents, the last 2 held out (default: %(default)s)")
    parser.add_argument("--text", choices=("hotpotqa", "novel", "both"), default="hotpotqa",
                        help="with --probe: the calibration text, the package's HotpotQA paragraphs (hotpotqa, "
                        "default), the suite's dev-half novel (novel), or both alternating (probe_calibration.py)")
    parser.add_argument("--attention-errors", action="store_true",
                        help="add the attention-output error curves (what lowrank:allocate=error reads) to existing "
                        "joint bases (--bases, default: the ones shipped for the model), measured on the same "
                        "calibration text, and write bases and curves to OUT (a fresh fit writes them anyway)")
    parser.add_argument("--copy-weights", action="store_true",
                        help="add each layer's copy weight (what lowrank:allocate=copy, the default below a half "
                        "and on models with sliding-window layers, reads) to existing joint bases with error curves "
                        "(--bases, default: the shipped ones): the rise of "
                        "the model's loss on a second reading of 1,024 held-out calibration tokens when only that "
                        "layer is stored at a quarter (copy_weights.py); write bases and weights to OUT")
    parser.add_argument("--bases", default=None,
                        help="with --attention-errors or --copy-weights: the bases to add to (default: the shipped "
                        "ones)")
    parser.add_argument("--value-fit", choices=("pca", "attention", "oblique"), default="pca",
                        help="joint bases: plain PCA of the values (pca, default: what the package ships), or (for "
                        "research) value bases fitted to the attention output after the output projection, tokens "
                        "weighted by the attention they receive, orthogonal projections (attention), or the same "
                        "problem's exact solution with an encoder beside each basis (oblique); keys are PCA of the "
                        "pre-RoPE keys either way")
    parser.add_argument("--numbers", type=float, default=None,
                        help="low-rank bases: the share of the calibration words taken from HotpotQA paragraphs that "
                        "hold a number of 5 or more digits (default: %(default)s, the package's choice: "
                        "calibration.LOWRANK_NUMBERS); the error curves and copy weights read the same text")
    parser.add_argument("--max-rank", type=int, default=None,
                        help="components kept per basis (default: all of a joint basis, head_dim // 2 per head); "
                        "lowrank's ranks may not exceed it")
    parser.set_defaults(func=run)


def run(args) -> int:
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    from ..calibration import (
        LOWRANK_NUMBERS,
        calibrate,
        calibrate_joint,
        calibration_ids,
        calibration_name,
        held_out_ids,
        save_bases,
    )
    from ..models import load_model

    if args.tokens < 16:
        raise ValueError(f"--tokens must be at least 16, got {args.tokens}")
    if args.probe:
        return run_probe(args)
    if args.sharing:
        return run_sharing(args)
    if args.key_scales:
        return run_key_scales(args)
    if args.floors:
        return run_floors(args)
    if args.attention_errors:
        return run_attention_errors(args)
    if args.copy_weights:
        return run_copy_weights(args)
    numbers = LOWRANK_NUMBERS if args.numbers is None else args.numbers
    model, tokenizer = load_model(args.model)
    if args.heads == "joint":
        tensors, metadata, report = calibrate_joint(
            model, calibration_ids(tokenizer, args.tokens, numbers), max_rank=args.max_rank,
            error_ids=held_out_ids(tokenizer, args.tokens, numbers=numbers), value_fit=args.value_fit,
            text=calibration_name(numbers))
        metadata["numbers"] = str(numbers)
    else:
        tensors, metadata, report = calibrate(model, calibration_ids(tokenizer, args.tokens, numbers),
                                              max_rank=args.max_rank, text=calibration_name(numbers))
    path = save_bases(tensors, metadata, args.out)
    print(f"Bases for {metadata['model']} ({metadata['layers']} layers x {metadata['kv_heads']} KV heads x "
          f"head_dim {metadata['head_dim']}, {metadata['max_rank']} components kept per basis, "
          f"{args.heads}) from {metadata['tokens']} tokens of {metadata['text']}: {path}")
    if args.heads == "joint":
        _joint_report(report)
    else:
        _per_head_report(report)
    return 0


def run_attention_errors(args) -> int:
    """`calibrate --attention-errors`: add the attention-output error curves to existing joint bases."""
    from ..calibration import add_error_curves, bases_numbers, held_out_ids, load_bases, save_bases
    from ..models import load_model

    model, tokenizer = load_model(args.model)
    tensors, metadata = load_bases(args.bases, model.config)
    add_error_curves(model, held_out_ids(tokenizer, int(metadata["tokens"]), numbers=bases_numbers(metadata)),
                     tensors, metadata)
    path = save_bases(tensors, metadata, args.out)
    print(f"Bases with attention-error curves for {metadata['model']}: {path}")
    print("Relative attention-output error per layer at a quarter / half of the dimensions (keys | values):")
    layers, step = int(metadata["layers"]), int(metadata["error_step"])
    width = tensors["layers.0.key_mean"].numel()
    for layer in range(layers):
        cells = []
        for kind in ("key", "value"):
            curve = tensors[f"layers.{layer}.{kind}_error"]
            cells.append("/".join(f"{float(curve[min(r // step, len(curve) - 1)]):.3f}"
                                  for r in (width // 4, width // 2)))
        print(f"{layer:5d}  {cells[0]:>12s}  {cells[1]:>12s}")
    return 0


def run_copy_weights(args) -> int:
    """`calibrate --copy-weights`: add each layer's copy weight to existing joint bases (copy_weights.py)."""
    from ..calibration import bases_numbers, held_out_ids, load_bases, save_bases
    from ..copy_weights import COPY_TOKENS, add_copy_weights, boost_weights
    from ..models import load_model

    model, tokenizer = load_model(args.model)
    tensors, metadata = load_bases(args.bases, model.config)
    ids = held_out_ids(tokenizer, int(metadata["tokens"]), COPY_TOKENS, numbers=bases_numbers(metadata))
    costs = add_copy_weights(model, ids, args.bases, tensors, metadata, progress=lambda line: print(line, flush=True))
    path = save_bases(tensors, metadata, args.out)
    print(f"Bases with copy weights for {metadata['model']}: {path}")
    print("layer  copy-loss rise  weight")
    for layer, (cost, weight) in enumerate(zip(costs, boost_weights(costs), strict=True)):
        print(f"{layer:5d}  {cost:+14.4f}  {weight:6.2f}")
    return 0


def _joint_report(report: list[dict]) -> None:
    ranks = list(report[0]["key"])
    print("Share of variance kept at " + "/".join(map(str, ranks)) + " dimensions of the layer's KV heads "
          "(jointly; one basis per head with the same dimensions in all):")
    print(f"{'layer':>5s}  {'keys (pre-RoPE)':>16s}  {'per head':>12s}  {'values':>12s}  {'per head':>12s}")
    for row in report:
        kinds = ("key", "key_per_head", "value", "value_per_head")
        cells = ["/".join(f"{row[k][r]:.2f}" for r in ranks) for k in kinds]
        print(f"{row['layer']:5d}  {cells[0]:>16s}  {cells[1]:>12s}  {cells[2]:>12s}  {cells[3]:>12s}")
    mean = {k: sum(row[k][ranks[0]] for row in report) / len(report)
            for k in ("key", "key_per_head", "value", "value_per_head")}
    print(f"mean at a quarter: keys {mean['key']:.3f} (per head {mean['key_per_head']:.3f}), values "
          f"{mean['value']:.3f} (per head {mean['value_per_head']:.3f})")


def _per_head_report(report: list[dict]) -> None:
    ranks = list(report[0]["key"])
    print("Share of variance kept at rank " + "/".join(map(str, ranks)) + " (keys post-RoPE as cached; pre-RoPE "
          "for comparison; values):")
    print(f"{'layer':>5s}  {'keys (post-RoPE)':>20s}  {'keys (pre-RoPE)':>20s}  {'values':>20s}")
    for row in report:
        cells = ["/".join(f"{row[k][r]:.2f}" for r in ranks) for k in ("key", "key_pre_rope", "value")]
        print(f"{row['layer']:5d}  {cells[0]:>20s}  {cells[1]:>20s}  {cells[2]:>20s}")
    mean = {k: sum(row[k][ranks[1]] for row in report) / len(report) for k in ("key", "key_pre_rope", "value")}
    print(f"mean at rank {ranks[1]}: keys post-RoPE {mean['key']:.3f}, pre-RoPE {mean['key_pre_rope']:.3f}, "
          f"values {mean['value']:.3f}")


def run_sharing(args) -> int:
    """`calibrate --sharing`: fit the head-sharing maps and report what predicting each level of heads costs."""
    from ..calibration import calibrate_sharing, calibration_ids, held_out_ids, load_sharing, save_sharing
    from ..models import load_model
    from ..sharing_costs import COPY_TOKENS, add_copy_costs

    model, tokenizer = load_model(args.model)
    tensors, metadata, report = calibrate_sharing(model, calibration_ids(tokenizer, args.tokens))
    path = save_sharing(tensors, metadata, args.out)
    # Each level's copy cost, measured on the maps as saved (float16) and on text they were not fitted on.
    tensors, metadata = load_sharing(path, model.config)
    ids = held_out_ids(tokenizer, args.tokens, COPY_TOKENS)
    copy_costs = add_copy_costs(model, ids, path, tensors, metadata, progress=lambda line: print(line, flush=True))
    path = save_sharing(tensors, metadata, args.out)
    print(f"Head-sharing maps for {metadata['model']} ({metadata['layers']} layers x {metadata['kv_heads']} KV heads "
          f"x head_dim {metadata['head_dim']}) from {metadata['tokens']} tokens of {metadata['text']}: {path}")
    print("Cost of predicting 1, 2, ... heads of a layer from the others (residual over the heads' mean square; "
          "keys pre-RoPE), and the heads predicted:")
    print(f"{'layer':>5s}  {'keys':>20s}  {'values':>20s}  predicted (keys | values)")
    for row in report:
        cells = ["/".join(f"{c:.3f}" for c in row[kind]) for kind in ("key", "value")]
        print(f"{row['layer']:5d}  {cells[0]:>20s}  {cells[1]:>20s}  {row['key_predicted']} | {row['value_predicted']}")
    print(f"Copy cost of each level alone (the rise of the loss on a second reading of {COPY_TOKENS} held-out tokens; "
          "what shared_heads:ratio spends by, allocate=copy):")
    print(f"{'layer':>5s}  {'keys':>20s}  {'values':>20s}")
    for layer, pair in enumerate(copy_costs):
        cells = ["/".join(f"{c:+.4f}" for c in kind_costs) for kind_costs in pair]
        print(f"{layer:5d}  {cells[0]:>20s}  {cells[1]:>20s}")
    return 0


def run_probe(args) -> int:
    """`calibrate --probe`: fit and write KVzap's probes, and report each layer's fit on the held-out documents."""
    from ..models import load_model
    from ..probe_calibration import calibrate_probe
    from ..probes import save_probe

    if args.documents < 3:
        raise ValueError(f"--documents must be at least 3 (2 are held out), got {args.documents}")
    tokens = 1024 if args.tokens == 2048 else args.tokens  # the lowrank default is not the probe's
    model, tokenizer = load_model(args.model)
    tensors, metadata, report = calibrate_probe(
        model, tokenizer, tokens=tokens, documents=args.documents, held_out=2, text=args.text,
        progress=lambda n, total: print(f"KVzip scores of document {n}/{total}", flush=True),
    )
    path = save_probe(tensors, metadata, args.out)
    print(f"KVzap probes for {metadata['model']} ({len(report)} layers, {metadata['form']}: "
          f"{metadata['shapes']}) from {metadata['tokens']} tokens of {metadata['text']}: {path}")
    print(f"Fit on the {metadata['held_out']} held-out documents (R^2 of log KVzip score; Spearman per head):")
    print(f"{'layer':>5s}  {'alpha':>7s}  {'R2 train':>8s}  {'R2 held out':>11s}  {'Spearman':>8s}")
    for row in report:
        print(f"{row['layer']:5d}  {row['alpha']:7.0e}  {row['r2_train']:8.3f}  {row['r2_held_out']:11.3f}  "
              f"{row['spearman_held_out']:8.3f}")
    mean = {k: sum(row[k] for row in report) / len(report) for k in ("r2_held_out", "spearman_held_out")}
    print(f"mean held out: R^2 {mean['r2_held_out']:.3f}, Spearman {mean['spearman_held_out']:.3f}")
    return 0


def run_key_scales(args) -> int:
    """`calibrate --key-scales`: write each layer's key channel scales and how uneven the channels were."""
    from ..calibration import calibrate_key_scales, calibration_ids, save_key_scales
    from ..models import load_model

    model, tokenizer = load_model(args.model)
    tensors, metadata, report = calibrate_key_scales(model, calibration_ids(tokenizer, args.tokens), stat=args.stat)
    path = save_key_scales(tensors, metadata, args.out)
    print(f"Key channel scales ({metadata['stat']}) for {metadata['model']} ({metadata['layers']} layers x "
          f"{metadata['kv_heads']} KV heads x head_dim {metadata['head_dim']}) from {metadata['tokens']} tokens of "
          f"{metadata['text']}: {path}")
    print("Widest key channel over the median channel, per layer (the most uneven KV head):")
    print("  " + " ".join(f"{row['layer']}:{row['widest_over_median']:.1f}" for row in report))
    return 0


def run_floors(args) -> int:
    """`calibrate --floors`: fit and write KVzip's per-layer floors, and report the facts each ratio keeps."""
    from ..calibration import save_floors
    from ..floor_calibration import calibrate_floors
    from ..models import load_model

    try:
        ratios = tuple(float(r) for r in args.ratios.split(","))
    except ValueError:
        ratios = ()
    if not ratios or not all(0 < r < 1 for r in ratios):
        raise ValueError(f"--ratios must be numbers between 0 and 1 (exclusive), comma-separated, got {args.ratios!r}")
    documents = 4 if args.documents == 12 else args.documents  # the probe's default is not the floors'
    if documents < 1:
        raise ValueError(f"--documents must be at least 1, got {documents}")
    tokens = 2000 if args.tokens == 2048 else args.tokens
    model, tokenizer = load_model(args.model)
    tensors, metadata, report = calibrate_floors(model, tokenizer, documents=documents, tokens=tokens, ratios=ratios,
                                                 progress=lambda line: print(line, flush=True))
    path = save_floors(tensors, metadata, args.out)
    print(f"Layer floors for {metadata['model']} (full-attention layers {tensors['layers'].tolist()}) from "
          f"{documents} documents of about {tokens} tokens of {metadata['text']} with facts written in: {path}")
    print(f"{'ratio':>6s}  {'floors (layer: share of the document)':<40s}  {'answer tokens right':>20s}  "
          f"{'log-prob':>9s}")
    for row in report:
        floors = ", ".join(f"{layer}: {f:g}" for layer, f in row["floors"].items())
        print(f"{row['ratio']:6g}  {floors:<40s}  {row['accuracy_without']:.3f} -> {row['accuracy']:.3f}  "
              f"{row['log_prob_without']:.2f} -> {row['log_prob']:.2f}")
    return 0
