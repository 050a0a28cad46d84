"""Convert an HF BF16 checkpoint into a weight format SGLang loads (bf16, fp8, nvfp4, mxfp4).

``mixfleet convert --format FMT SRC DST``: prints one summary line on success; on bad input
prints one line naming the problem and exits non-zero, leaving no ``DST`` behind.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", required=True, metavar="FMT", help="bf16 | fp8 | nvfp4 | mxfp4")
    parser.add_argument("src", metavar="SRC", help="HF BF16 checkpoint directory")
    parser.add_argument("dst", metavar="DST", help="output directory (must not exist, or be empty)")
    parser.add_argument("--workers", type=int, default=None, help="conversion threads (default: torch's)")
    parser.add_argument("--fsync", action="store_true", help="make every file durable before finishing")
    parser.add_argument(
        "--checksum",
        default="xxh3_128",
        metavar="ALG",
        help="per-file digest in manifest.json: xxh3_128 (default) | sha256",
    )
    parser.add_argument(
        "--quantize-all",
        action="store_true",
        help="fp8: refuse a layer SGLang's block-FP8 loader cannot load quantized "
        "(default: keep it BF16 and list it in ignored_layers)",
    )


def run(args: argparse.Namespace) -> int:
    from weight_sync.convert import convert_checkpoint

    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be at least 1")
    t0 = time.perf_counter()
    try:
        m = convert_checkpoint(
            Path(args.src),
            Path(args.dst),
            args.format,
            workers=args.workers,
            fsync=args.fsync,
            checksum=args.checksum,
            quantize_all=args.quantize_all,
        )
    except OSError as exc:
        raise UserError(f"{exc.filename or args.dst}: {exc.strerror or exc}") from None
    dt = time.perf_counter() - t0
    kept = f", {len(m.unquantized)} modules kept BF16 (manifest.json: unquantized)" if m.unquantized else ""
    print(
        f"converted {args.src} -> {args.dst}: format {m.format}, {m.tensor_count} tensors, "
        f"{len(m.files)} files, {m.total_bytes} bytes, {dt:.2f}s{kept}"
    )
    return 0
