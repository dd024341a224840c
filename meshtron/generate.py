"""Text generation with a KV cache on one device: `meshtron generate`.

Bad input is refused before anything is generated, in one line naming the flag and its valid range (exit 2):
an empty prompt, ``--max-new-tokens`` below 1, a negative or non-finite ``--temperature``, a negative
``--top-k``, ``--top-p`` outside (0, 1]. A prompt that fills the model's context
(``--max-position-embeddings``, else ``--seq-length`` of the checkpoint) is refused too, rather than cut:
which end of a prompt may be dropped is the user's choice. A prompt that leaves room for fewer than
``--max-new-tokens`` tokens generates up to the end of the context, and a note says so.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional

import torch
import torch.nn as nn

from meshtron.errors import ConfigError


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """Sample token ids [batch] from logits [batch, vocab] (greedy when temperature is 0)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
# The layers run eagerly: the sequence grows by a token per step, a new shape for a compiled layer (and a new
# recording for a CUDA-graphed one) each time.
@torch.compiler.set_stance("force_eager")
def generate_ids(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int = 0, use_cache: bool = True,
                 eod: Optional[int] = None) -> list[int]:
    """Generate continuation ids for one prompt. ``use_cache=False`` reruns the whole sequence each step."""
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    ids = list(prompt_ids)
    max_len = model.cfg.max_position_embeddings or model.cfg.seq_length
    caches: Optional[dict] = {} if use_cache else None
    tokens = torch.tensor([ids], device=device)
    offset = 0
    out: list[int] = []
    for _ in range(max_new_tokens):
        if len(ids) >= max_len:
            break
        logits = model(tokens=tokens, caches=caches, position_offset=offset)[:, -1]
        nxt = int(sample_next(logits, temperature, top_k, top_p, gen)[0])
        out.append(nxt)
        ids.append(nxt)
        if eod is not None and nxt == eod:
            break
        if use_cache:
            offset = len(ids) - 1
            tokens = torch.tensor([[nxt]], device=device)
        else:
            tokens = torch.tensor([ids], device=device)
    return out


def generate_text(model: nn.Module, tokenizer, prompt: str, max_new_tokens: int = 64, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> str:
    ids = tokenizer.encode(prompt)
    out = generate_ids(model, ids, max_new_tokens, temperature, top_k, top_p, seed, eod=tokenizer.eod)
    return prompt + tokenizer.decode([i for i in out if i != tokenizer.eod])


def check_sampling_flags(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ConfigError naming the first sampling flag outside its valid range."""
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise ConfigError(f"--temperature {temperature}: must be a finite number >= 0 (0 samples greedily)")
    if top_k < 0:
        raise ConfigError(f"--top-k {top_k}: must be >= 0 (0 keeps every token)")
    if not 0 < top_p <= 1:  # also false for nan
        raise ConfigError(f"--top-p {top_p}: must be in (0, 1] (1 keeps every token)")


def context_length(model: nn.Module) -> int:
    """Positions the model generates within (what :func:`generate_ids` stops at)."""
    return model.cfg.max_position_embeddings or model.cfg.seq_length


def prompt_ids(tokenizer, prompt: str, context: int) -> list[int]:
    """The prompt's token ids; ConfigError naming --prompt when it is empty or leaves no room in ``context``."""
    if not prompt:
        raise ConfigError("--prompt is empty: give the text to continue (at least one token)")
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} encodes to no tokens: give the text to continue (at least one token)")
    if len(ids) >= context:
        raise ConfigError(f"--prompt is {len(ids)} tokens; the model's context holds {context}, which leaves no room "
                          f"to generate: give a prompt of at most {context - 1} tokens (meshtron does not cut it)")
    return ids


def generate_main(argv: list[str]) -> int:
    """`meshtron generate --load DIR --prompt TEXT [...]`."""
    parser = argparse.ArgumentParser(prog="meshtron generate", description="Sample text from a meshtron checkpoint.")
    parser.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
    parser.add_argument("--prompt", required=True,
                        help="text to continue; it must fit in the model's context with room for one new token "
                             "(a longer prompt is refused, not cut)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate, at least 1 (fewer where the context ends first: a note says so)")
    parser.add_argument("--temperature", type=float, default=0.8, help=">= 0; 0 samples greedily (default 0.8)")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0: all (default 40)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the likeliest tokens whose probabilities sum to p, in (0, 1]; 1: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--no-verify-checkpoint", action="store_true",
                        help="load without checking the checkpoint's files against the checksums in its manifest")
    args = parser.parse_args(argv)
    check_sampling_flags(args.max_new_tokens, args.temperature, args.top_k, args.top_p)  # before the slow load
    from meshtron.checkpoint import CheckpointError, load_for_inference

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model, tokenizer = load_for_inference(args.load, device, verify=not args.no_verify_checkpoint)
    except CheckpointError as err:
        print(f"meshtron generate: error: {err}", file=sys.stderr)
        return 2
    if tokenizer is None:
        print(f"meshtron generate: error: the checkpoint in {args.load} has no tokenizer", file=sys.stderr)
        return 2
    context = context_length(model)
    ids = prompt_ids(tokenizer, args.prompt, context)
    room = context - len(ids)
    if args.max_new_tokens > room:
        print(f"meshtron generate: note: the prompt's {len(ids)} tokens leave room for {room} new tokens in the "
              f"model's context of {context}; generating at most {room} (--max-new-tokens {args.max_new_tokens})",
              file=sys.stderr)
    out = generate_ids(model, ids, min(args.max_new_tokens, room), args.temperature, args.top_k, args.top_p,
                       args.seed, eod=tokenizer.eod)
    print(args.prompt + tokenizer.decode([i for i in out if i != tokenizer.eod]))
    return 0
