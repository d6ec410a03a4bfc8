"""``python -m hebrus_torch.convert SRC DST --bits {4,8} --group-size {32,64,128} [--quantize-lm-head]
[--max-shard-size 5GB]``: exits 0 after writing DST, 1 with the error's message when it refuses."""

from __future__ import annotations

import argparse
import re
import sys

from hebrus_torch.errors import HebrusError

from .core import DEFAULT_MAX_SHARD_BYTES, ConvertError, convert

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1000000"`` -> bytes; ConvertError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if m is None or m[2].upper() not in _UNITS:
        raise ConvertError(f"hebrus::convert: --max-shard-size {text!r} is not a size (e.g. 5GB, 500MiB)")
    return int(m[1]) * _UNITS[m[2].upper()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hebrus_torch.convert",
                                     description="Write a Qwen4Exp checkpoint with affine-quantized weights.")
    parser.add_argument("src", help="the checkpoint directory to convert")
    parser.add_argument("dst", help="the directory to write (must not exist)")
    parser.add_argument("--bits", type=int, default=4, help="4 or 8 (default 4)")
    parser.add_argument("--group-size", type=int, default=64, help="32, 64 or 128 (default 64)")
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantize lm_head too")
    parser.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_BYTES),
                        help="the most data bytes per file (default 5GB)")
    args = parser.parse_args(argv)
    try:
        dst = convert(args.src, args.dst, bits=args.bits, group_size=args.group_size,
                      quantize_lm_head=args.quantize_lm_head, max_shard_bytes=parse_size(args.max_shard_size))
    except HebrusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
