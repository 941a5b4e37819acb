"""``fastattn demo``: train both reference models for about a minute, on a CPU if need be.

1. the encoder-decoder :class:`~fastattn.models.Transformer` learns to reverse random digit
   strings (a synthetic task: exact-match accuracy of greedy decoding on fresh strings);
2. the decoder-only :class:`~fastattn.models.GPT` learns a small character corpus shipped in
   ``fastattn/data`` (an original public-domain story), then writes a greedy continuation
   with its KV cache.

Each phase trains for ``--seconds`` (default 30) with a progress bar (tqdm when installed) and
writes the losses (``losses.json``), the summary (``summary.json``) and, when matplotlib is
installed, the loss curves (``loss.png``) to ``--out`` (default: a new temporary directory, whose
path is printed; nothing is written to the current directory unless asked).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastattn.models.config import GPTConfig, TransformerConfig
from fastattn.models.gpt import GPT
from fastattn.models.transformer import Transformer

CORPUS = Path(__file__).resolve().parents[1] / "data" / "lighthouse.txt"
PAD, BOS, EOS, FIRST_DIGIT = 0, 1, 2, 3


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--task", choices=["reverse", "gpt", "all"], default="all", help="which model(s) to train")
    parser.add_argument("--seconds", type=float, default=30.0, help="training time per task (default 30)")
    parser.add_argument("--max-steps", type=int, default=None, help="stop a task after this many steps")
    parser.add_argument("--backend", default=None, help="fastattn backend (default: automatic)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--out", default=None,
                        help="folder for losses, summary and loss.png (default: a new temporary directory, printed)")
    parser.add_argument("--corpus", default=str(CORPUS), help="text file for the GPT (default: the shipped story)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for torch (default on a CPU: 1, fastest for these tiny models; 0 keeps torch's)",
    )
    parser.add_argument("--sample-chars", type=int, default=200, help="characters the GPT writes at the end")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _progress(desc: str, total: int | None, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True)


def _train(model, step_loss, *, seconds, max_steps, lr, desc, progress) -> list[float]:
    """AdamW (warmup, cosine decay) for ``seconds`` or ``max_steps``; the per-step losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    bar = _progress(desc, max_steps, progress)
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    step = 0
    while (max_steps is None or step < max_steps) and time.perf_counter() - start < seconds:
        # warmup, then cosine decay to lr / 10 over the budget (time or steps, whichever is nearer)
        done = (time.perf_counter() - start) / seconds
        if max_steps:
            done = max(done, step / max_steps)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))
        loss = step_loss()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        elif progress and step % 100 == 0:
            print(f"  {desc} step {step}: loss {losses[-1]:.3f}", flush=True)
    if bar is not None:
        bar.close()
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------------
# 1. Sequence reversal with the encoder-decoder


def reversal_batch(batch: int, generator: torch.Generator, min_len: int = 3, max_len: int = 10, digits: int = 10):
    """Random digit strings (tokens ``3 ..``, padded with 0) and their reversals as decoder input
    ``[BOS] + reversed`` and target ``reversed + [EOS]`` (padded)."""
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=generator)
    src = torch.full((batch, max_len), PAD, dtype=torch.long)
    tgt = torch.full((batch, max_len + 2), PAD, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        seq = torch.randint(FIRST_DIGIT, FIRST_DIGIT + digits, (n,), generator=generator)
        src[b, :n] = seq
        tgt[b, 0] = BOS
        tgt[b, 1 : n + 1] = seq.flip(0)
        tgt[b, n + 1] = EOS
    return src, tgt


def run_reversal(args, device, log) -> dict:
    config = TransformerConfig(
        src_vocab_size=FIRST_DIGIT + 10, tgt_vocab_size=FIRST_DIGIT + 10, d_model=64, nhead=4, num_encoder_layers=2,
        num_decoder_layers=2, dim_feedforward=128, dropout=0.0, max_len=16, pad_id=PAD,  # endless data: no dropout
    )
    model = Transformer(config, backend=args.backend, device=device)
    gen = torch.Generator().manual_seed(args.seed)

    def step_loss():
        src, tgt = (t.to(device) for t in reversal_batch(64, gen))
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1), ignore_index=PAD)

    log(f"[1/2] Transformer ({sum(p.numel() for p in model.parameters()):,} parameters) learns to reverse digit strings")
    losses = _train(
        model, step_loss, seconds=args.seconds, max_steps=args.max_steps, lr=3e-3, desc="reverse",
        progress=not args.no_progress,
    )
    src, tgt = reversal_batch(200, torch.Generator().manual_seed(args.seed + 1))
    out = model.greedy_decode(src.to(device), max_len=tgt.shape[1] - 1, bos_id=BOS, eos_id=EOS).cpu()
    width = min(out.shape[1], tgt.shape[1])
    pred = torch.full_like(tgt, PAD)
    pred[:, :width] = out[:, :width]
    correct = ((pred == tgt) | (tgt == PAD)).all(dim=1)
    accuracy = correct.float().mean().item()
    show = lambda t: "".join(str(int(x) - FIRST_DIGIT) for x in t if x >= FIRST_DIGIT)  # noqa: E731
    log(f"  {len(losses)} steps, final loss {_tail(losses):.3f}, exact-match accuracy {accuracy:.1%} on 200 new strings")
    for i in range(3):
        log(f"  {show(src[i]):>10s} -> {show(pred[i]):<10s} {'ok' if correct[i] else 'wrong'}")
    return {"steps": len(losses), "final_loss": _tail(losses), "accuracy": accuracy, "losses": losses}


# ---------------------------------------------------------------------------------------------
# 2. Character-level GPT


def run_gpt(args, device, log) -> dict:
    text = Path(args.corpus).read_text(encoding="utf-8")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    config = GPTConfig(vocab_size=len(chars), block_size=64, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    model = GPT(config, backend=args.backend, device=device)
    gen = torch.Generator().manual_seed(args.seed)

    def batch(source, size=32):
        starts = torch.randint(0, len(source) - config.block_size - 1, (size,), generator=gen)
        x = torch.stack([source[s : s + config.block_size] for s in starts.tolist()])
        y = torch.stack([source[s + 1 : s + 1 + config.block_size] for s in starts.tolist()])
        return x.to(device), y.to(device)

    def step_loss():
        return model(*batch(train))[1]

    log(f"[2/2] GPT ({model.num_parameters():,} parameters) learns {len(text):,} characters of {Path(args.corpus).name}")
    losses = _train(
        model, step_loss, seconds=args.seconds, max_steps=args.max_steps, lr=3e-3, desc="gpt",
        progress=not args.no_progress,
    )
    with torch.no_grad():
        val_loss = sum(model(*batch(val, 16))[1].item() for _ in range(4)) / 4
    prompt = "The keeper"
    idx = torch.tensor([[stoi.get(c, 0) for c in prompt]], device=device)
    sample = "".join(chars[i] for i in model.generate(idx, args.sample_chars, greedy=True)[0].tolist())
    g = torch.Generator(device=device).manual_seed(args.seed)
    sampled = "".join(
        chars[i] for i in model.generate(idx, args.sample_chars, temperature=0.8, top_k=10, generator=g)[0].tolist()
    )
    log(f"  {len(losses)} steps, final train loss {_tail(losses):.3f}, validation loss {val_loss:.3f} "
        f"(uniform guess: {math.log(len(chars)):.3f})")
    log("  greedy continuation (KV cache):")
    log("    " + sample.replace("\n", "\n    "))
    log("  sampled continuation (temperature 0.8, top-k 10):")
    log("    " + sampled.replace("\n", "\n    "))
    return {
        "steps": len(losses), "final_loss": _tail(losses), "val_loss": val_loss, "sample": sample, "sampled": sampled,
        "losses": losses,
    }


# ---------------------------------------------------------------------------------------------


def _tail(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else float("nan")


def _plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        ax.plot(r["losses"], linewidth=0.8)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else 0)
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace, device: torch.device) -> int:
    torch.manual_seed(args.seed)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.out is None:
        out = Path(tempfile.mkdtemp(prefix="fastattn-demo-"))
    else:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
    log(f"output folder: {out}")
    log(f"fastattn demo on {device} (backend: {args.backend or 'automatic'}), {args.seconds:g} s per task")
    results = {}
    if args.task in ("reverse", "all"):
        results["reverse"] = run_reversal(args, device, log)
    if args.task in ("gpt", "all"):
        results["gpt"] = run_gpt(args, device, log)
    (out / "losses.json").write_text(json.dumps({k: r["losses"] for k, r in results.items()}))
    summary = {k: {kk: v for kk, v in r.items() if kk != "losses"} for k, r in results.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plotted = _plot(results, out / "loss.png")
    png = f", {out / 'loss.png'}" if plotted else " (no matplotlib: no loss.png)"
    log(f"wrote {out / 'losses.json'}, {out / 'summary.json'}{png}")
    return 0


def main(argv=None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="fastattn demo", description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
