"""Ranks fail together: one mechanism, shared by every dispatcher, that turns a problem on
one rank into the same error on every rank, in the same collective step.

A rank that raises on its own leaves its peers waiting in a collective it never joins, or,
if it catches the error and goes on, pairs its next step with their current one. So a rank
with a problem still takes part in the step's exchange, carrying the problem as data, and
every rank decides from the same gathered data, which makes the error identical everywhere.

* :func:`agree_on_config` runs once, when a dispatcher is built: every rank sends its
  configuration (and its constructor's ValueError, if any) in one small all-gather, and a
  disagreement (E, H, K, max tokens, dtypes, world size, placement, ...) or a bad argument
  on any rank raises a ValueError on every rank that names the field and the value of each
  rank. Checking once keeps the steps free of it, and catches the mismatches that no step
  check could name (a wrong E turns into wrong rows, not an error).
* :class:`StepCheck` runs in every eager step. :meth:`StepCheck.inspect` validates this
  rank's inputs without raising and without a host read, into a fixed-size int64 status
  vector (``STATUS_WORDS``): a bad-input flag with the message's text, T, H, dtype, the
  range of the expert ids (computed on the device) and the largest per-peer pair count.
  The dispatcher exchanges the statuses inside a collective it runs anyway where it can
  (the eager all-to-all's counts message, the low-latency gloo message), or in one small
  all-gather, and :meth:`StepCheck.settle` reads them (one host read) and raises the same
  ValueError on every rank when any rank's input was bad, naming each bad rank. A rank
  whose input was bad sends an empty but well-formed contribution, so nobody waits.
* Combine too: a rank whose ``expert_out`` is wrong (:func:`expert_out_problem`) still sends
  its part of the exchange (NaN rows) with a status (:meth:`StepCheck.problem_status`) in
  front of it, so nobody waits, and :meth:`StepCheck.settle_combine` raises the same
  ValueError on every rank. Where the exchange runs in host memory (gloo) reading the
  statuses costs nothing and every rank raises in that combine. A CUDA tensor would need a
  device sync, which combine never makes: the statuses stay on the device and are read with
  the next eager dispatch's own host read, where every rank raises (the bad rank also at
  once, in its combine; its peers' combine results hold NaN where its rows belonged).
* Inside a CUDA graph nothing can be read on the host: the dispatchers carry a per-rank
  flag on the device instead, and :func:`raise_for_flagged_ranks` is the host check after
  the replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from moekit.ep.checks import is_int
from moekit.ep.dispatcher import id_range_problem, validate_routing
from moekit.ep.peers import PeerGroup

CONFIG_BYTES = 8192  # one rank's configuration record (JSON, zero-padded)
_VALUE_CHARS = 160  # longest shown value of a configuration field
_ERROR_CHARS = 2000  # longest constructor error carried in a configuration record

# Step status: int64 words, then the bad input's message as UTF-8 bytes.
BAD, TOKENS, HIDDEN, DTYPE, ID_MIN, ID_MAX, MAX_COUNT = range(7)
NUMERIC_WORDS = 8
TEXT_WORDS = 48  # 384 bytes of message
STATUS_WORDS = NUMERIC_WORDS + TEXT_WORDS
STATUS_BYTES = STATUS_WORDS * 8

# dtype codes in a status (-1: none or another dtype)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


# -- configuration, once at construction ----------------------------------------------------


def agree_on_config(peers: PeerGroup, kind: str, fields: dict[str, Any], build: Callable[[], Any]) -> Any:
    """Run ``build`` (the constructor's checks), then check with every rank; return its result.

    ``fields`` are the constructor's arguments as given (shown with ``repr``), so ranks can
    be compared even when one of them is invalid. With several ranks a ValueError of
    ``build`` does not escape on its own: it travels in this rank's record and every rank
    raises together. With one rank it is raised directly.
    """
    if peers.world_size == 1:
        return build()
    result, error = None, None
    try:
        result = build()
    except ValueError as e:
        error = str(e)[:_ERROR_CHARS]
    record = json.dumps({"kind": kind, "error": error,
                         "fields": {name: _show(value) for name, value in fields.items()}})
    records = [json.loads(text) for text in _exchange_text(peers, record, CONFIG_BYTES, what="configuration check")]
    problem = config_problem(records)
    if problem:
        raise ValueError(problem)
    return result


def config_problem(records: list[dict]) -> str | None:
    """The error every rank raises for these per-rank configuration records, or None."""
    kinds = [r["kind"] for r in records]
    if len(set(kinds)) > 1:
        return (f"ranks built different objects in the same collective step: {_per_rank(kinds)} "
                "(build the same dispatcher, in the same order, on every rank)")
    kind, parts = kinds[0], []
    errors = [r["error"] for r in records]
    if any(errors):
        parts.append("bad argument(s): " + "; ".join(
            f"{_rank_list(ranks)}: {text}" for text, ranks in _group_by_value(errors).items() if text))
    names = list(dict.fromkeys(name for r in records for name in r["fields"]))
    for name in names:
        values = [r["fields"].get(name, "(missing)") for r in records]
        if len(set(values)) > 1:
            parts.append(f"{name} differs across ranks: {_per_rank(values)}")
    if not parts:
        return None
    return (f"{kind} on {len(records)} ranks: " + "; ".join(parts)
            + " (checked when it was built; every rank raises this error)")


# -- every eager step --------------------------------------------------------------------------


@dataclass
class LocalStatus:
    """This rank's step status: ``ok`` (its input passed the local checks) and the
    ``STATUS_WORDS`` int64 ``words`` to send, on the step's device."""

    ok: bool
    words: torch.Tensor


class StepCheck:
    """Validate a step's inputs on every rank and raise the same error everywhere.

    ``hidden``, ``top_k``, ``max_tokens``, ``dtype`` (None: any) and ``device`` (None: any
    device the process group can move) are the dispatcher's limits.
    """

    def __init__(self, owner: str, peers: PeerGroup, num_experts: int, *, hidden: int | None = None,
                 top_k: int | None = None, max_tokens: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | None = None):
        self.owner, self.peers, self.num_experts = owner, peers, num_experts
        self.hidden, self.top_k, self.max_tokens, self.dtype, self.device = hidden, top_k, max_tokens, dtype, device
        # Every rank's combine status of the last combine whose statuses could not be read
        # for free (CUDA), [world_size, STATUS_WORDS]; the next eager dispatch reads them.
        self.pending: torch.Tensor | None = None

    def inspect(self, x: Any, topk_ids: Any, topk_weights: Any, *, problem: str | None = None) -> LocalStatus:
        """This rank's status for the step. Never raises for bad input, never reads the device.

        ``problem``: a bad input the caller found itself (its own argument rules), reported
        like the checks' own."""
        problem = problem if problem is not None else self._problem(x, topk_ids, topk_weights)
        if problem is not None:
            return LocalStatus(False, _to_device(_numeric(1, 0, -1, -1) + _text_words(problem), self.peers.device))
        T, H = x.shape
        words = _to_device(_numeric(0, T, H, _dtype_code(x.dtype)) + [0] * TEXT_WORDS, x.device)
        if topk_ids.numel():  # the id range stays on the device: it is read with the peers' statuses
            words[ID_MIN:ID_MAX + 1] = torch.stack(torch.aminmax(topk_ids)).to(torch.int64)
        return LocalStatus(True, words)

    def problem_status(self, problem: str | None, device: torch.device) -> torch.Tensor:
        """A status that says only "ok" or what the caller found wrong (combine's checks): no
        sizes, no ids, so every good rank's is the same. No host read."""
        words = _numeric(1 if problem else 0, 0, -1, -1) + (_text_words(problem) if problem else [0] * TEXT_WORDS)
        return _to_device(words, device)

    def settle(self, numeric: list[list[int]], text: Callable[[int], torch.Tensor],
               step: str = "this step") -> list[list[int]]:
        """Raise the step's error (the same on every rank), or return the numeric words per rank.

        ``numeric``: the first ``NUMERIC_WORDS`` words of every rank's status, on the host;
        ``text(r)``: rank r's ``TEXT_WORDS`` message words (read only when r's input was bad);
        ``step``: what no rank ran, for the message.
        """
        problems = []
        for rank, words in enumerate(numeric):
            if words[BAD]:
                problems.append((rank, _decode_text(text(rank))))
            else:
                bad_ids = id_range_problem(self.num_experts, words[ID_MIN], words[ID_MAX])
                if bad_ids:
                    problems.append((rank, bad_ids))
        if problems:
            raise ValueError(self._message(problems, step))
        shapes = [(w[HIDDEN], w[DTYPE]) for w in numeric]
        if len(set(shapes)) > 1:  # the messages would be sized differently on different ranks
            shown = [f"H={h}, dtype {_dtype_name(code)}" for h, code in shapes]
            raise ValueError(f"{self.owner}: ranks passed x of different hidden sizes or dtypes in the same step: "
                             f"{_per_rank(shown)}; no rank ran the step (every rank raises this error)")
        return numeric

    def settle_gathered(self, statuses: torch.Tensor, step: str = "this step") -> list[list[int]]:
        """:meth:`settle` for the statuses of all ranks, ``[world_size, STATUS_WORDS]``; a
        previous combine's statuses still to be read (:attr:`pending`) are read with them."""
        host = statuses[:, :NUMERIC_WORDS].reshape(-1)
        pending = self.pending_flags()
        if pending is not None:
            host = torch.cat([host, pending.to(host.device)])
        host = host.tolist()  # the step's one host read
        if pending is not None:
            self.raise_pending(host[-len(pending):])
        numeric = [host[r * NUMERIC_WORDS:(r + 1) * NUMERIC_WORDS] for r in range(statuses.shape[0])]
        return self.settle(numeric, lambda rank: statuses[rank, NUMERIC_WORDS:], step)

    def settle_combine(self, statuses: torch.Tensor, problem: str | None) -> None:
        """Every rank's combine status ``[world_size, STATUS_WORDS]``, as received with the
        combine's rows, and this rank's own ``problem``: raise the same error on every rank
        where reading them is free (host memory); else keep them for the next eager dispatch
        (:attr:`pending`) and raise only on the bad rank, now."""
        if host_readable(statuses):
            self.settle_gathered(statuses, "this combine")
            return
        self.pending = statuses
        if problem is not None:
            raise ValueError(f"{self.owner}: {problem} (this rank's rows went out as NaN; every rank raises at "
                             "its next dispatch)")

    def pending_flags(self) -> torch.Tensor | None:
        """``[world_size]`` int64 bad-input flags of the pending combine statuses (None: none)."""
        return None if self.pending is None else self.pending[:, BAD]

    def raise_pending(self, flags: list[int]) -> None:
        """With the pending combine's ``flags`` read on the host (the dispatch's one host read):
        forget them, and raise the same error on every rank if a rank's ``expert_out`` was bad."""
        pending, self.pending = self.pending, None
        problems = [(rank, _decode_text(pending[rank, NUMERIC_WORDS:])) for rank, bad in enumerate(flags) if bad]
        if problems:
            raise ValueError(self._message(problems, "this step") + " (found in the previous combine, whose "
                             "results hold NaN where those ranks' rows belonged)")

    def _problem(self, x, topk_ids, topk_weights) -> str | None:
        try:
            validate_routing(x, topk_ids, topk_weights, self.num_experts, hidden=self.hidden, top_k=self.top_k,
                             max_tokens=self.max_tokens, dtype=self.dtype, check_ids=False)
        except ValueError as error:
            return str(error)
        if self.device is not None and x.device != self.device:
            return f"x is on {x.device}, but this dispatcher's buffers are on {self.device}"
        if self.peers.needs_cuda and x.device.type != "cuda":
            return f"x is on {x.device}; this dispatcher's process group is NCCL, which needs CUDA tensors"
        return None

    def _message(self, problems: list[tuple[int, str]], step: str = "this step") -> str:
        if self.peers.world_size == 1:
            return problems[0][1]
        listed = "; ".join(f"rank {rank}: {text}" for rank, text in problems)
        return (f"{self.owner}: bad input on {len(problems)} of {self.peers.world_size} ranks, so no rank ran "
                f"{step} (every rank raises this error): {listed}")


def host_readable(t: torch.Tensor) -> bool:
    """Whether reading ``t`` on the host is free: it lives in host memory, where the collective
    that filled it (gloo) has already waited for the peers. A CUDA tensor needs a device sync."""
    return t.device.type == "cpu"


def expert_out_problem(expert_out: Any, tokens: torch.Tensor, name: str = "[E_local, capacity, H]") -> str | None:
    """What is wrong with ``expert_out`` for a combine of the dispatch that delivered ``tokens``
    (its rows go back bit for bit, so it has their shape, dtype and device), or None."""
    if not isinstance(expert_out, torch.Tensor):
        return f"expert_out must be a tensor {name} = {list(tokens.shape)}, got {type(expert_out).__name__}"
    if expert_out.shape != tokens.shape:
        return f"expert_out must be {name} = {list(tokens.shape)} (the dispatched tokens'), got " \
               f"{list(expert_out.shape)}"
    if expert_out.dtype != tokens.dtype:
        return f"expert_out must have dtype {tokens.dtype} (the dispatched tokens'), got {expert_out.dtype}"
    if expert_out.device != tokens.device:
        return f"expert_out is on {expert_out.device}, but the dispatched tokens are on {tokens.device}"
    return None


def checked_expert_out(expert_out: Any, tokens: torch.Tensor, *, alone: bool,
                       name: str = "[E_local, capacity, H]") -> tuple[torch.Tensor, str | None]:
    """Combine's check of ``expert_out`` (:func:`expert_out_problem`): ``(expert_out, None)`` when
    it is fine. Otherwise ValueError at once when the rank is ``alone`` (no peer waits for it,
    or nothing can be exchanged, as inside a CUDA graph's capture), else ``(NaN rows shaped like
    tokens, the problem)``: the rank still sends its part, and the problem travels in its status."""
    problem = expert_out_problem(expert_out, tokens, name)
    if problem is None:
        return expert_out, None
    if alone:
        raise ValueError(problem)
    return torch.full_like(tokens, float("nan")), problem


def status_rows(words: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """A status's ``STATUS_WORDS`` int64 ``words`` as raw bytes in as many rows of
    ``row_bytes`` bytes as it takes (zero-padded), to travel in front of rows of that width."""
    rows = -(-STATUS_BYTES // row_bytes)
    out = torch.zeros(rows * row_bytes, dtype=torch.uint8, device=words.device)
    out[:STATUS_BYTES] = words.view(torch.uint8)
    return out.view(rows, row_bytes)


def statuses_from_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[P, STATUS_WORDS]`` int64 from every sender's status rows ``[P, rows, row_bytes]``."""
    return rows.reshape(rows.shape[0], -1)[:, :STATUS_BYTES].clone().view(torch.int64)


def raise_for_flagged_ranks(owner: str, flags: list[bool], problem: str, error: type = ValueError) -> None:
    """The host check after a CUDA-graph replay: ``flags[r]`` is rank r's device flag, the
    same list on every rank, so every rank raises the same ``error`` naming the flagged ranks."""
    ranks = [r for r, flagged in enumerate(flags) if flagged]
    if not ranks:
        return
    where = f"{_rank_list(ranks)} of {len(flags)}" if len(flags) > 1 else "this rank"
    raise error(f"{owner}: {where}: {problem}")


# -- helpers ---------------------------------------------------------------------------------


def _numeric(bad: int, tokens: int, hidden: int, dtype_code: int) -> list[int]:
    words = [0] * NUMERIC_WORDS
    words[BAD], words[TOKENS], words[HIDDEN], words[DTYPE] = bad, tokens, hidden, dtype_code
    words[ID_MIN] = words[ID_MAX] = -1  # no ids: the range of an all-masked step
    return words


def _to_device(words: list[int], device: torch.device) -> torch.Tensor:
    """int64 words on ``device`` without a host sync: a plain copy from pageable memory
    would wait for the device's queued work, so a GPU copy goes through pinned memory,
    asynchronously (the caching host allocator keeps the buffer until the copy is done)."""
    host = torch.tensor(words, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "(other)"


def _text_words(text: str) -> list[int]:
    """``text`` as TEXT_WORDS int64 words of zero-padded UTF-8, cut at a character boundary."""
    size = TEXT_WORDS * 8
    data = text.encode()
    if len(data) > size:
        data = data[:size - 3].decode(errors="ignore").encode() + "…".encode()
    data = data.ljust(size, b"\0")
    return np.frombuffer(data, dtype=np.int64).tolist()


def _decode_text(words: torch.Tensor) -> str:
    data = words.detach().to("cpu", torch.int64).numpy().tobytes()
    return data.rstrip(b"\0").decode(errors="replace")


def _exchange_text(peers: PeerGroup, text: str, size: int, *, what: str) -> list[str]:
    data = text.encode()
    if len(data) > size:  # only a pathological repr gets here; the check itself must not fail
        data = data[:size]
    buf = torch.frombuffer(bytearray(data.ljust(size, b"\0")), dtype=torch.uint8).to(peers.device)
    gathered = peers.all_gather(buf, what=what).cpu().numpy()
    return [row.tobytes().rstrip(b"\0").decode(errors="replace") for row in gathered]


def _show(value: Any) -> str:
    if is_int(value):  # numpy and Python ints of one value compare equal across ranks
        value = int(value)
    shown = repr(value)
    return shown if len(shown) <= _VALUE_CHARS else shown[:_VALUE_CHARS - 3] + "..."


def _group_by_value(values: list) -> dict:
    groups: dict = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return groups


def _rank_list(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _per_rank(values: list) -> str:
    """'8 on rank 0; 16 on ranks 1, 2' (values grouped, in order of first appearance)."""
    return "; ".join(f"{value} on {_rank_list(ranks)}" for value, ranks in _group_by_value(values).items())
