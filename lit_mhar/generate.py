"""``lit-mhar generate``: sample text from a lit-mhar checkpoint with a KV cache, for every variant.

Decoding is the usual two stages over :meth:`lit_mhar.model.LM.forward` with a
:class:`~lit_mhar.model.KVCache`:

- prefill: the whole prompt in one forward pass (``pos=0``), the same computation as training:
  causal attention over the prompt and the same depth-routing op, including the two-phase block
  computation on the fused kernels (every routing site of a block routed against the completed
  blocks in one pass, then an online-softmax merge with the block in progress; AttnRes, Kimi,
  arXiv 2603.15031, Sec. 4);
- decode: one token per step; attention reads the cached keys and values of earlier positions,
  while depth routing needs nothing cached: it mixes the new token's own depth history (its
  embedding and its sublayer outputs, or their block sums), which the step computes anyway.

Sampling: ``temperature`` 0 is greedy (argmax); otherwise softmax(logits / temperature), restricted
to the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``
(nucleus sampling, Holtzman et al. 2020), drawn with a seeded generator.

The tokenizer is the ``tokenizer.json`` of the data the model was trained on: given explicitly,
found beside the checkpoint (``lit-mhar convert`` writes it there), or in the dataset folder a
``lit-mhar fit`` checkpoint records (its DataModule hyperparameter ``data_dir``). Text is decoded
incrementally (``tokenizers.decoders.DecodeStream``), so a character split over several byte-level
BPE tokens is printed once it is complete.

This module imports only torch, lit-mhar's model and its checkpoint reader at import time (not
litdata or Lightning, which lit_mhar.data would bring); the tokenizer is imported on use.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, TextIO

import torch
from torch import Tensor

from lit_mhar.checkpoint import TOKENIZER_NAME, NonFiniteCheckpoint, UnreadableCheckpoint, read_checkpoint, tokenizer_candidates, training_vocabulary
from lit_mhar.config import ModelConfig
from lit_mhar.model import LM

EOS_TOKEN = "<|endoftext|>"  # as lit_mhar.data.EOS_TOKEN; it ends every document in a prepared dataset
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# how each stop reason reads in what generate prints
STOPPED = {"eos": "stopped: end of text", "max_new_tokens": "stopped: max_new_tokens", "context": "stopped: context full"}


@dataclass
class Generation:
    """What :func:`generate` returns.

    Attributes:
        prompt: the prompt text.
        prompt_ids: its token ids (``[EOS]`` for an empty prompt).
        token_ids: per sample, the new token ids (without the EOS that stopped it).
        texts: per sample, the new text (the incremental decode of ``token_ids`` after the prompt;
            bytes of a character left incomplete at the end are dropped).
        stop_reasons: per sample, ``eos``, ``max_new_tokens`` or ``context`` (the model's
            ``seq_len`` was reached).
        seed: the sampling seed (the one drawn when none was given), to reproduce the run.
        prefill_tokens_per_s: prompt tokens / prefill seconds, in the steady state (after a warm-up
            pass, see :func:`generate_ids`).
        decode_tokens_per_s: tokens generated over all samples / decode seconds, likewise.
    """

    prompt: str
    prompt_ids: list[int]
    token_ids: list[list[int]]
    texts: list[str]
    stop_reasons: list[str]
    seed: int
    prefill_tokens_per_s: float = field(default=math.nan)
    decode_tokens_per_s: float = field(default=math.nan)


# ----------------------------------------------------------------------------- sampling


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raise ValueError naming the value and its valid range for a bad sampling setting."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature={temperature!r} is invalid; valid: a finite number >= 0 (0 = greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} is invalid; valid: an integer >= 1, or None for no top-k cut")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} is invalid; valid: 0 < top_p <= 1, or None for no nucleus cut")


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """Next token ids ``[B]`` int64 from logits ``[B, V]``.

    ``temperature`` 0: argmax (``top_k`` and ``top_p`` are irrelevant). Otherwise a draw from
    softmax(logits / temperature) (float32) after keeping the ``top_k`` largest logits and the
    smallest set of most likely tokens whose probability reaches ``top_p`` (the most likely token
    is always kept). Ties at the k-th logit are all kept.

    Raises:
        ValueError: a bad setting (see :func:`check_sampling`).
    """
    check_sampling(temperature, top_k, top_p)
    return _draw(logits, temperature, top_k, top_p, generator)


def _draw(logits: Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float], generator: Optional[torch.Generator]) -> Tensor:
    """:func:`sample_next` without the argument check (decoding checks once, not per token)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens more likely than it already reach top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# ----------------------------------------------------------------------------- decoding


@torch.no_grad()
def generate_ids(
    model: LM,
    prompt_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    num_samples: int = 1,
    generator: Optional[torch.Generator] = None,
    eos_id: Optional[int] = None,
    vocab_limit: Optional[int] = None,
    on_step: Optional[Callable[[Tensor], None]] = None,
    warmup: bool = True,
) -> tuple[Tensor, list[str], dict[str, float]]:
    """Sample ``num_samples`` continuations of one prompt: one prefill pass, then one token per step.

    Args:
        model: the language model (eval mode; on the device and in the dtype to run in).
        prompt_ids: ``[T]`` int64 token ids on the model's device, ``1 <= T <= seq_len``.
        max_new_tokens: tokens to generate per sample, at most; fewer when every sample has ended
            with ``eos_id`` or the context is full (at most ``seq_len - T + 1`` tokens fit: the
            last one is sampled from position ``seq_len - 1`` and never fed back).
        temperature, top_k, top_p, generator: as :func:`sample_next`.
        num_samples: M continuations, decoded as one batch (the prompt is prefilled once, its
            keys and values broadcast to the M rows of the cache).
        eos_id: a sample that draws this id ends; later positions of its row hold ``eos_id``.
        vocab_limit: never sample ids >= this (a model whose embedding table is padded beyond the
            tokenizer's vocabulary).
        on_step: called after every step with the new ids ``[M]`` (for streaming); the time it
            takes (detokenising, printing) is not counted in ``decode_s``.
        warmup: run the prefill and one decode step once, untimed, into a scratch cache first, so
            that ``prefill_s`` and ``decode_s`` time the steady state, not the first call's kernel
            compilation and launch set-up (Triton, CUDA, ``torch.compile``), which can take seconds.
            It draws nothing from ``generator``: the samples are the same either way.

    Returns:
        ``(tokens, stop_reasons, timing)``: ``[M, n]`` int64 new ids (n <= max_new_tokens),
        per sample ``eos`` / ``max_new_tokens`` / ``context``, and ``prefill_s`` / ``decode_s``
        (seconds, device-synchronised; after the warm-up) with ``decode_tokens`` (ids generated by
        decode steps) and ``warmup_s`` (the warm-up's seconds, 0 without one).

    Raises:
        ValueError: an empty or too long prompt, ``max_new_tokens`` or ``num_samples`` < 1, a bad
            sampling setting.
    """
    cfg = model.cfg
    check_sampling(temperature, top_k, top_p)
    for name, value in (("max_new_tokens", max_new_tokens), ("num_samples", num_samples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; valid: an integer >= 1")
    T = prompt_ids.numel()
    if not 1 <= T <= cfg.seq_len:
        raise ValueError(f"prompt of {T} tokens; valid: 1 to {cfg.seq_len} tokens (the model's context, seq_len)")
    n_new = min(max_new_tokens, cfg.seq_len - T + 1)
    device = prompt_ids.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def pick(logits: Tensor) -> Tensor:
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits = logits[:, :vocab_limit]
        return _draw(logits, temperature, top_k, top_p, generator)

    warmup_s = 0.0
    if warmup:
        started = time.perf_counter()
        scratch = model.new_cache(num_samples, max_len=T + 1)
        first = model(prompt_ids.view(1, T), cache=scratch, pos=0)[:, -1].expand(num_samples, -1)
        if n_new > 1:
            model(first.argmax(-1).view(num_samples, 1), cache=scratch, pos=T)
        del scratch, first
        sync()
        warmup_s = time.perf_counter() - started
    cache = model.new_cache(num_samples, max_len=T + n_new - 1)
    started = time.perf_counter()
    logits = model(prompt_ids.view(1, T), cache=cache, pos=0)[:, -1].expand(num_samples, -1)
    sync()
    prefill_s = time.perf_counter() - started
    out = torch.empty(num_samples, n_new, dtype=torch.long, device=device)
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    started = time.perf_counter()
    outside_s = 0.0  # time in on_step, which is not decoding
    n = 0
    while True:
        ids = pick(logits)
        if eos_id is not None:
            ids = ids.masked_fill(done, eos_id)
            done |= ids == eos_id
        out[:, n] = ids
        n += 1
        if on_step is not None:
            sync()  # the step's own work ends here, not inside the callback's first device read
            t = time.perf_counter()
            on_step(ids)
            outside_s += time.perf_counter() - t
        if n == n_new or (eos_id is not None and bool(done.all())):
            break
        logits = model(ids.view(num_samples, 1), cache=cache, pos=T + n - 1)[:, -1]
    sync()
    decode_s = time.perf_counter() - started - outside_s
    ended_by_eos = done.tolist()
    cut = "context" if n_new < max_new_tokens else "max_new_tokens"
    reasons = ["eos" if e else cut for e in ended_by_eos]
    timing = {"prefill_s": prefill_s, "decode_s": decode_s, "decode_tokens": float(num_samples * (n - 1)), "warmup_s": warmup_s}
    return out[:, :n], reasons, timing


# ----------------------------------------------------------------------------- checkpoint and tokenizer


def load_checkpoint(ckpt: str | os.PathLike) -> tuple[ModelConfig, dict[str, Tensor], dict[str, Any]]:
    """``(config, LM weights, checkpoint dict)`` of a lit-mhar checkpoint (``lit-mhar fit`` or ``convert``).

    Reads through :func:`lit_mhar.checkpoint.read_checkpoint` (``weights_only``, memory-mapped).

    Raises:
        FileNotFoundError: no such path.
        ValueError: a directory, or a file that is not a lit-mhar Lightning checkpoint ("unknown
            checkpoint format"), naming what is valid; weights that are not finite (a fit that
            diverged).
    """

    path = Path(ckpt).expanduser()
    valid = "valid: a lit-mhar .ckpt file written by `lit-mhar fit` (runs/.../checkpoints/*.ckpt) or `lit-mhar convert` (OUTPUT_DIR/model.ckpt)"
    if not path.exists():
        raise FileNotFoundError(f"ckpt={str(ckpt)!r} does not exist; {valid}")
    if path.is_dir():
        hint = f" (it holds {path / 'model.ckpt'}: pass that)" if (path / "model.ckpt").is_file() else ""
        raise ValueError(
            f"ckpt={str(ckpt)!r} is a directory, an unknown checkpoint format{hint}; {valid}. "
            "A Hugging Face model directory must be converted first (lit-mhar convert)"
        )
    try:
        return read_checkpoint(path)
    except UnreadableCheckpoint as e:  # torch.load on a file that is no torch checkpoint: RuntimeError, UnpicklingError, ...
        raise ValueError(
            f"ckpt={str(ckpt)!r} is not a checkpoint lit-mhar can read: unknown checkpoint format "
            f"(torch.load could not read the file: {type(e.__cause__).__name__}); {valid}"
        ) from None
    except NonFiniteCheckpoint:
        raise
    except ValueError as e:
        raise ValueError(f"ckpt={str(ckpt)!r}: unknown checkpoint format ({e}); {valid}") from None


def find_tokenizer(ckpt: str | os.PathLike, checkpoint: dict[str, Any], tokenizer: Optional[str] = None) -> Path:
    """The ``tokenizer.json`` to use: ``tokenizer`` (a file, or a folder holding one) when given,
    else the first of :func:`tokenizer_candidates` that exists.

    Raises:
        FileNotFoundError: the given tokenizer does not exist, or none is found; the message lists
            the places looked at and how to pass one.
    """
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        path = path / TOKENIZER_NAME if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer={tokenizer!r}: no such file; valid: a `tokenizers` tokenizer.json or a folder holding one")
        return path
    candidates = tokenizer_candidates(ckpt, checkpoint)
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"no tokenizer for ckpt={str(ckpt)!r}: looked for {', '.join(str(p) for p in candidates)}. Pass --tokenizer "
        "PATH: the tokenizer.json of the dataset the model was trained on (lit-mhar prepare writes it into the dataset folder)"
    )


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N`` as a torch.device.

    Raises:
        ValueError: an unknown or unsupported device, or CUDA asked for where it is not available.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is unknown; valid: 'auto', 'cpu', 'cuda', 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is unsupported; valid: 'auto', 'cpu', 'cuda', 'cuda:N'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but CUDA is not available; valid here: 'cpu'")
    return dev


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown; valid: {['auto', *DTYPES]}")
    return DTYPES[dtype]


class TextStreams:
    """Incremental detokenisation of M samples (``tokenizers.decoders.DecodeStream``, one per sample).

    Each stream starts from the prompt's ids, so a tokenizer whose decoding depends on the left
    context (leading spaces, a character split over byte-level tokens) gives the same text as
    decoding prompt + continuation at once. A sample's stream ends at ``eos_id``.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        prompt_ids: the prompt's ids.
        n: samples M.
        eos_id: the id that ends a sample (not decoded), or None.
        echo: a text file (``sys.stdout``) to write sample 0's new text to as it completes, or None.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], n: int, eos_id: Optional[int] = None, echo: Optional[TextIO] = None) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.eos_id, self.echo = tokenizer, eos_id, echo
        self.decoders = [DecodeStream(ids=list(prompt_ids), skip_special_tokens=True) for _ in range(n)]
        self.pieces: list[list[str]] = [[] for _ in range(n)]
        self.ended = [False] * n

    def step(self, ids: list[int]) -> None:
        """Add one new id per sample (``[M]`` ints); print sample 0's completed text to ``echo``."""
        for i, t in enumerate(ids):
            if self.ended[i] or t == self.eos_id:
                self.ended[i] = True
                continue
            piece = self.decoders[i].step(self.tokenizer, t)
            if piece:
                self.pieces[i].append(piece)
                if i == 0 and self.echo is not None:
                    self.echo.write(piece)
                    self.echo.flush()

    def texts(self) -> list[str]:
        """The new text of every sample so far."""
        return ["".join(p) for p in self.pieces]


# ----------------------------------------------------------------------------- generate


def generate(
    ckpt: str,
    prompt: str = "",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    seed: Optional[int] = None,
    num_samples: int = 1,
    tokenizer: Optional[str] = None,
    stop_at_eos: bool = True,
    device: str = "auto",
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
    stream: bool = True,
    verbose: bool = True,
) -> Generation:
    """Sample text from a lit-mhar checkpoint: prefill the prompt in one pass, then decode with a KV cache.

    Works for every variant (prenorm, AttnRes / MHAR, Block AttnRes, Delta) on CPU and CUDA (depth
    routing through the fused Triton kernels there, two-phase for blocks). With ``verbose``, the
    prompt and the new text are printed to stdout, as tokens come (``stream`` and one sample) or
    each sample when done; a summary line goes to stderr.

    Args:
        ckpt: A lit-mhar checkpoint (``.ckpt``), from ``lit-mhar fit`` or ``lit-mhar convert``.
        prompt: Text to continue. Empty: start from the end-of-text token, i.e. a new document.
        max_new_tokens: Tokens to generate per sample at most (fewer at the end-of-text token or
            when the model's context, ``seq_len``, is full).
        temperature: Softmax temperature; 0 is greedy decoding (argmax). Must be >= 0.
        top_k: Sample only among the k most likely tokens (None: all).
        top_p: Sample only among the most likely tokens whose probability reaches p, 0 < p <= 1
            (nucleus sampling; None: all).
        seed: Seed of the sampling generator (None: a random one, reported in the result).
        num_samples: Continuations of the prompt, decoded together as one batch.
        tokenizer: The ``tokenizer.json`` (or a folder holding it); default: beside the checkpoint,
            else in the dataset folder the checkpoint was trained on. Its size must be the
            vocabulary the model was trained on.
        stop_at_eos: End a sample at the end-of-text token (``<|endoftext|>``), if the tokenizer has it.
        device: ``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: Weights and activations: ``auto`` (bfloat16 on a GPU that has it, else float32),
            ``float32``, ``bfloat16`` or ``float16``.
        stream: Print one sample's tokens as they come (False: each sample when it is done).
        verbose: Print the samples and the summary at all (False: print nothing, only return).

    Returns:
        A :class:`Generation`: prompt ids, new token ids and text per sample, why each stopped, the
        seed, prefill and decode tokens/s.

    Raises:
        ValueError: a bad argument (temperature < 0, top_k < 1, top_p outside (0, 1], ...), an
            unknown checkpoint format, a prompt longer than the model's ``seq_len``, a tokenizer
            whose vocabulary exceeds the model's, a ``tokenizer`` given whose size is not the
            vocabulary the model was trained on (:func:`lit_mhar.checkpoint.training_vocabulary`:
            a padded embedding table is fine when the data's manifest or the tokenizer beside the
            checkpoint says so); all before the model is built.
        FileNotFoundError: no checkpoint at ``ckpt``, or no tokenizer found (the message lists
            where it looked).
    """
    check_sampling(temperature, top_k, top_p)
    for name, value in (("max_new_tokens", max_new_tokens), ("num_samples", num_samples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; valid: an integer >= 1")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed={seed!r} is invalid; valid: an integer in [0, 2**63), or None for a random one")
    dev = resolve_device(device)
    run_dtype = _resolve_dtype(dtype, dev)

    cfg, weights, checkpoint = load_checkpoint(ckpt)
    tok_path = find_tokenizer(ckpt, checkpoint, tokenizer)
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as e:  # tokenizers raises a bare Exception on a file it cannot parse
        raise ValueError(f"tokenizer {str(tok_path)!r} is not a `tokenizers` tokenizer.json ({e})") from None
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    if tok_vocab > cfg.vocab_size:
        raise ValueError(
            f"tokenizer {str(tok_path)!r} has {tok_vocab} ids, the model only {cfg.vocab_size} (vocab_size): "
            "it is not the model's tokenizer; pass the one of its training data with --tokenizer"
        )
    if tokenizer is not None:  # the one found by default is the model's own (the reference below)
        trained_on, where = training_vocabulary(ckpt, checkpoint, cfg)
        if tok_vocab != trained_on:
            raise ValueError(
                f"tokenizer={tokenizer!r} has {tok_vocab} ids, but the model was trained on a vocabulary of {trained_on} "
                f"({where}): it is not the model's tokenizer, and its ids would decode to other text. Pass the "
                "tokenizer.json of the model's training data (lit-mhar prepare writes it into the dataset folder), or leave "
                "--tokenizer out to use the one the checkpoint points to"
            )
    eos_id = tok.token_to_id(EOS_TOKEN)
    if prompt:
        prompt_ids = tok.encode(prompt, add_special_tokens=False).ids
    elif eos_id is not None:
        prompt_ids = [eos_id]
    else:
        raise ValueError(f"prompt is empty and tokenizer {str(tok_path)!r} has no {EOS_TOKEN!r} to start a document from; give a prompt")
    if len(prompt_ids) > cfg.seq_len:
        raise ValueError(
            f"prompt is {len(prompt_ids)} tokens long; valid: at most {cfg.seq_len} tokens (the model's context, seq_len)"
        )

    fits = cfg.seq_len - len(prompt_ids) + 1  # the last new token is sampled at the last position, never fed back
    if verbose and max_new_tokens > fits:
        print(
            f"[lit-mhar generate] note: max_new_tokens={max_new_tokens} is cut to {fits}: the prompt's {len(prompt_ids)} tokens "
            f"and the new ones fill the model's context of {cfg.seq_len} tokens (seq_len)",
            file=sys.stderr,
            flush=True,
        )
    with torch.device(dev):
        model = LM(cfg)
    model.load_state_dict(weights)
    model.to(run_dtype).eval().requires_grad_(False)
    del weights
    if seed is None:
        seed = random.SystemRandom().randrange(2**63)
    generator = torch.Generator(device=dev).manual_seed(seed)

    streams = TextStreams(tok, prompt_ids, num_samples, eos_id if stop_at_eos else None, echo=sys.stdout if verbose and stream and num_samples == 1 else None)
    if streams.echo is not None:
        print(prompt, end="", flush=True)
    ids, reasons, timing = generate_ids(
        model,
        torch.tensor(prompt_ids, dtype=torch.long, device=dev),
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        num_samples=num_samples,
        generator=generator,
        eos_id=eos_id if stop_at_eos else None,
        vocab_limit=tok_vocab,
        on_step=lambda step_ids: streams.step(step_ids.tolist()),
    )
    token_ids = []
    for row, reason in zip(ids.tolist(), reasons):
        token_ids.append(row[: row.index(eos_id)] if reason == "eos" else row)
    texts = streams.texts()
    result = Generation(
        prompt=prompt,
        prompt_ids=list(prompt_ids),
        token_ids=token_ids,
        texts=texts,
        stop_reasons=reasons,
        seed=seed,
        prefill_tokens_per_s=len(prompt_ids) / timing["prefill_s"] if timing["prefill_s"] > 0 else math.inf,
        decode_tokens_per_s=timing["decode_tokens"] / timing["decode_s"] if timing["decode_s"] > 0 else math.nan,
    )
    if verbose:
        if streams.echo is not None:
            print(flush=True)
        else:
            for i, text in enumerate(texts):
                print(f"--- sample {i} ({STOPPED[reasons[i]]}) ---\n{prompt}{text}", flush=True)
        print(
            f"[lit-mhar generate] {cfg.residual} H={cfg.heads} S={cfg.block_size} on {dev} ({str(run_dtype).removeprefix('torch.')}): "
            f"{len(prompt_ids)} prompt tokens, {sum(len(t) for t in token_ids)} new over {num_samples} sample(s) "
            f"({', '.join(STOPPED[r] for r in sorted(set(reasons)))}); prefill {result.prefill_tokens_per_s:,.0f} tok/s, "
            f"decode {result.decode_tokens_per_s:,.1f} tok/s (steady state, after a {timing['warmup_s']:.1f} s warm-up pass "
            f"that compiles and sets up the kernels); seed {seed}",
            file=sys.stderr,
            flush=True,
        )
    return result
