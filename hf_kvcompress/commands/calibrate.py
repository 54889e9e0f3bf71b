"""`hf-kvcompress calibrate`: fit the low-rank codec's PCA bases on calibration text and report what they keep;
with `--probe`, KVzap's score probes (probe_calibration.py) and their fit."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit per-layer, per-head PCA bases of keys and values for the lowrank codec",
        description=__doc__ + " The bases are written to OUT/lowrank_bases.safetensors; a cache uses them as "
        "lowrank:bases=OUT (without `bases`, lowrank reads the bases shipped for the embedded models). The report: "
        "the share of each layer's key (post- and pre-RoPE) and value variance kept at a few ranks.")
    parser.add_argument("--model", default=None, help="model name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", required=True, help="directory for lowrank_bases.safetensors (required)")
    parser.add_argument("--tokens", type=int, default=2048,
                        help="calibration tokens (default: %(default)s; with --probe: tokens per document, 1024)")
    parser.add_argument("--probe", action="store_true",
                        help="fit KVzap's score probes instead (kvzap policy): OUT/kvzap_probe.safetensors, or OUT "
                        "itself when it ends in .safetensors; a cache uses them as kvzap:probe=OUT")
    parser.add_argument("--documents", type=int, default=12,
                        help="with --probe: calibration documents, the last 2 held out (default: %(default)s)")
    parser.add_argument("--max-rank", type=int, default=None,
                        help="components kept per head (default: head_dim // 2); lowrank's rank may not exceed it")
    parser.set_defaults(func=run)


def run(args) -> int:
    # torch and the lab load here, not when the module is: `hf-kvcompress --help` reads none (tests/test_cli.py)
    from ..calibration import calibrate, calibration_ids, save_bases
    from ..models import load_model

    if args.tokens < 16:
        raise ValueError(f"--tokens must be at least 16, got {args.tokens}")
    if args.probe:
        return run_probe(args)
    model, tokenizer = load_model(args.model)
    tensors, metadata, report = calibrate(model, calibration_ids(tokenizer, args.tokens), max_rank=args.max_rank)
    path = save_bases(tensors, metadata, args.out)
    ranks = list(report[0]["key"])
    print(f"Bases for {metadata['model']} ({metadata['layers']} layers x {metadata['kv_heads']} KV heads x "
          f"head_dim {metadata['head_dim']}, {metadata['max_rank']} components kept) from {metadata['tokens']} "
          f"tokens of {metadata['text']}: {path}")
    print("Share of variance kept at rank " + "/".join(map(str, ranks)) + " (keys post-RoPE as cached; pre-RoPE "
          "for comparison; values):")
    print(f"{'layer':>5s}  {'keys (post-RoPE)':>20s}  {'keys (pre-RoPE)':>20s}  {'values':>20s}")
    for row in report:
        cells = ["/".join(f"{row[k][r]:.2f}" for r in ranks) for k in ("key", "key_pre_rope", "value")]
        print(f"{row['layer']:5d}  {cells[0]:>20s}  {cells[1]:>20s}  {cells[2]:>20s}")
    mean = {k: sum(row[k][ranks[1]] for row in report) / len(report) for k in ("key", "key_pre_rope", "value")}
    print(f"mean at rank {ranks[1]}: keys post-RoPE {mean['key']:.3f}, pre-RoPE {mean['key_pre_rope']:.3f}, "
          f"values {mean['value']:.3f}")
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
        model, tokenizer, tokens=tokens, documents=args.documents, held_out=2,
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
