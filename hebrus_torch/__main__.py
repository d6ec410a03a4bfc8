"""``python -m hebrus_torch``: which ops run natively where, then a chunked-prefill demo on the best device."""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import hebrus_torch as ht
from hebrus_torch import _extension


def available_devices() -> list[str]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    if torch.backends.mps.is_available():
        devices.append("mps")
    return devices


def kernel_table() -> str:
    devices = available_devices()
    lines = [f"{'op':<16}" + "".join(f"{d:>12}" for d in devices)]
    for op in _extension.OP_NAMES:
        cells = ["native" if _extension.has_native_kernel(op, d) else "reference" for d in devices]
        lines.append(f"{op:<16}" + "".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def progress(done: int, total: int, width: int = 32) -> None:
    filled = width * done // max(total, 1)
    sys.stdout.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tokens")
    sys.stdout.flush()


def ple_demo(device: str, tokens: int, channels: int, layers: int, seed: int) -> bool:
    """A random token stream (with EOS) through PLEState in random chunks, checked against one shot."""
    gen = torch.Generator().manual_seed(seed)
    vocab, eos = 32000, 2
    params = [ht.PLEHashParams(torch.randint(1, 1 << 40, (3,), generator=gen) * 2 + 1,
                               torch.randint(50_000, 60_000, (16,), generator=gen),
                               torch.arange(16) * 60_000) for _ in range(layers)]
    weights = [torch.randn(channels, 4, generator=gen).to(device) for _ in range(layers)]

    def make() -> ht.PLEState:
        return ht.PLEState(layers, channels, vocab_size=vocab, eos_token_id=eos, max_sequences=2,
                           device=device, hash_params=params, conv_weights=weights)

    stream = torch.randint(0, vocab, (tokens,), generator=gen)
    stream[torch.rand(tokens, generator=gen) < 0.02] = eos
    x = torch.randn(tokens, channels, generator=gen).to(device)
    stream = stream.to(device)

    def run(state: ht.PLEState, seq: ht.SeqHandle, start: int, stop: int):
        cu = torch.tensor([0, stop - start], dtype=torch.int32, device=device)
        with ht.transaction(state):
            outs = [(state.ngram_ids(i, [seq], stream[start:stop], cu), state.conv(i, [seq], x[start:stop], cu))
                    for i in range(layers)]
        return outs

    one_shot = make()
    seq = one_shot.new_sequence()
    expected = run(one_shot, seq, 0, tokens)

    chunked = make()
    seq = chunked.new_sequence()
    rng = random.Random(seed)
    got, start = [], 0
    t0 = time.perf_counter()
    while start < tokens:
        stop = min(tokens, start + rng.choice([1, 2, 3, 17, 64, 256]))
        got.append(run(chunked, seq, start, stop))
        start = stop
        progress(start, tokens)
    if device == "mps":
        torch.mps.synchronize()
    elapsed = time.perf_counter() - t0
    print()
    same = all(torch.equal(torch.cat([g[i][j] for g in got]), expected[i][j]) for i in range(layers) for j in (0, 1))
    same = same and chunked.digest() == one_shot.digest()
    print(f"  {len(got)} random chunks vs one shot: ids, conv outputs, state digest "
          f"{'bitwise identical' if same else 'DIFFER'}")
    print(f"  chunked throughput: {tokens / elapsed:,.0f} tokens/s ({layers} PLE layers, C = {channels}, {device})")
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hebrus_torch", description=__doc__)
    parser.add_argument("--device", default=None, help="cpu, mps or cuda (default: the best available)")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--channels", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"hebrus_torch {ht.__version__}, torch {torch.__version__}")
    if _extension.EXTENSION_ERROR:
        print(f"compiled extension not loaded ({_extension.EXTENSION_ERROR}); every op runs its reference")
    print(kernel_table())
    device = args.device or available_devices()[-1]
    print(f"\nPLE demo on {device}:")
    ok = ple_demo(device, args.tokens, args.channels, args.layers, args.seed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
