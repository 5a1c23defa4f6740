"""Context parallelism's plan: which chunks of a sample each cp rank holds, which pieces of causal
attention it computes as key/value chunks pass around the ring, and what a layout needs for it
(`check_cp`). context.py and ring_attention.py apply it; the planner counts by it. Nothing here
communicates, and nothing here reads a tensor on a device.

A sample of T tokens is cut into 2N chunks of T/2N (N = cp). Under causal attention a query's work
grows with its position, so rank i holds chunks i and 2N-1-i (Megatron's and torchtitan's load
balance): every rank computes the same number of query-key pairs.

    T = 8 chunks, cp = 4:   rank 0 [c0 c7]  rank 1 [c1 c6]  rank 2 [c2 c5]  rank 3 [c3 c4]

With data.document_mask a query sees only the keys of its own document, so a token's work is its
position within its document plus one. `balanced` gives the ranks pairs of chunks by that work:
sorted by work, the heaviest chunk with the lightest, the second heaviest with the second lightest,
and so on, which makes the heaviest pair as light as pairing can (one document per sample gives
back the layout above). A rank keeps its chunks in position order, so its tokens' positions grow.

A ring step hands rank r the key/value chunks of rank `src`. Chunk pair (query chunk a, key chunk b):
b after a: nothing; b = a: causal; b before a: every key visible (`FULL`); with documents, a pair
whose tokens do not all share one document is `MASKED` (an explicit mask), and one none of whose
queries sees a key of its document is skipped. `step_blocks` merges what it can into fewer calls:
a rank's own chunks are one causal call, and pairs forming a rectangle of `FULL` are one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from teratrain.config_base import ConfigError

FULL, CAUSAL, MASKED = "full", "causal", "masked"


@dataclass(frozen=True)
class Split:
    """The chunks of one (micro-batch of) sample(s) over cp ranks: `chunks[r]`, rank r's chunk
    indices in position order, each chunk `chunk_len` tokens long."""

    cp: int
    chunk_len: int
    chunks: tuple[tuple[int, ...], ...]

    def positions(self, rank: int) -> np.ndarray:
        """Positions in the sample of rank `rank`'s tokens, in their local order."""
        L = self.chunk_len
        return np.concatenate([np.arange(c * L, (c + 1) * L) for c in self.chunks[rank]])

    @property
    def local_len(self) -> int:
        return self.chunk_len * len(self.chunks[0])


def zigzag(cp: int, seq_len: int) -> Split:
    """Rank i holds chunks i and 2cp-1-i of 2cp."""
    return Split(cp, seq_len // (2 * cp), tuple((i, 2 * cp - 1 - i) for i in range(cp)))


def token_work(docs: np.ndarray) -> np.ndarray:
    """(B, T) document ids -> (T,) attention work of each position summed over the samples: the keys a
    causal, document-masked query sees (its position within its document, plus one)."""
    B, T = docs.shape
    pos = np.broadcast_to(np.arange(T), (B, T))
    new = np.ones((B, T), dtype=bool)
    new[:, 1:] = docs[:, 1:] != docs[:, :-1]
    start = np.maximum.accumulate(np.where(new, pos, 0), axis=1)  # where each token's document starts
    return (pos - start + 1).sum(axis=0)


def balanced(cp: int, docs: np.ndarray) -> Split:
    """Pairs of chunks by attention work (module docstring), for the samples of `docs` (B, T) alike."""
    T = docs.shape[1]
    L = T // (2 * cp)
    work = token_work(docs)[:2 * cp * L].reshape(2 * cp, L).sum(axis=1)
    order = sorted(range(2 * cp), key=lambda c: (work[c], c))  # lightest first, ties by position
    pairs = [tuple(sorted((order[i], order[2 * cp - 1 - i]))) for i in range(cp)]
    pairs.sort()  # rank i gets the pair holding the i-th earliest lightest chunk: zigzag for one document
    return Split(cp, L, tuple(pairs))


def rank_work(split: Split, docs: np.ndarray | None) -> list[int]:
    """Query-key pairs each rank computes (docs None: one document per sample)."""
    T = split.chunk_len * 2 * split.cp
    work = token_work(docs) if docs is not None else np.arange(1, T + 1)
    return [int(work[split.positions(r)].sum()) for r in range(split.cp)]


@dataclass(frozen=True)
class Block:
    """One attention call of a ring step: local query rows [q0, q1) against the received key rows
    [k0, k1), with `kind` FULL, CAUSAL (square, diagonal) or MASKED."""

    q0: int
    q1: int
    k0: int
    k1: int
    kind: str


def pair_kind(split: Split, qc: int, kc: int, docs: np.ndarray | None) -> str | None:
    """What query chunk `qc` computes against key chunk `kc` (None: nothing)."""
    if kc > qc:
        return None
    kind = CAUSAL if kc == qc else FULL
    if docs is None:
        return kind
    L = split.chunk_len
    dq, dk = docs[:, qc * L:(qc + 1) * L], docs[:, kc * L:(kc + 1) * L]  # (B, L) each
    if ((dq == dq[:, :1]).all(axis=1) & (dk == dq[:, :1]).all(axis=1)).all():  # one document in each sample
        return kind
    if (dq.min(axis=1) > dk.max(axis=1)).all():  # every query's document starts after these keys
        return None
    return MASKED


def step_blocks(split: Split, rank: int, src: int, docs: np.ndarray | None = None) -> list[Block]:
    """The attention calls rank `rank` makes with rank `src`'s key/value chunks (module docstring)."""
    L, mine, theirs = split.chunk_len, split.chunks[rank], split.chunks[src]
    kinds = {(a, b): pair_kind(split, qc, kc, docs) for a, qc in enumerate(mine) for b, kc in enumerate(theirs)}
    if src == rank and all(kinds[a, a] == CAUSAL for a in range(len(mine))) and \
            all(kinds[a, b] == (FULL if a > b else None) for (a, b) in kinds if a != b):
        return [Block(0, len(mine) * L, 0, len(theirs) * L, CAUSAL)]  # own chunks, position order: one call
    full = [(a, b) for (a, b), k in kinds.items() if k == FULL]
    if full and len(full) == len(kinds) - sum(k is None for k in kinds.values()):
        qs, ks = sorted({a for a, _ in full}), sorted({b for _, b in full})
        contiguous = qs == list(range(qs[0], qs[-1] + 1)) and ks == list(range(ks[0], ks[-1] + 1))
        if contiguous and len(full) == len(qs) * len(ks):
            return [Block(qs[0] * L, (qs[-1] + 1) * L, ks[0] * L, (ks[-1] + 1) * L, FULL)]
    return [Block(a * L, (a + 1) * L, b * L, (b + 1) * L, k) for (a, b), k in sorted(kinds.items()) if k is not None]


def shape_problem(cp: int, cp_form: str, seq_len: int, n_heads: int, tp: int, sp: bool) -> str | None:
    """Why a model of this shape cannot be split over cp ranks (one sentence with the fix), or None.
    The planner refuses the same layouts through it."""
    pieces = 2 * cp * (tp if sp else 1)
    if seq_len % pieces:
        by = " x parallel.tp (sequence parallelism shards each rank's chunks)" if sp else ""
        return (f"parallel.cp={cp} cuts model.seq_len ({seq_len}) into 2 x cp{by} = {pieces} equal pieces; choose a "
                "model.seq_len that it divides")
    if cp_form == "all-to-all" and (n_heads // tp) % cp:
        return (f"parallel.cp_form=all-to-all gives each cp rank n_heads / (tp x cp) query heads, and {n_heads} heads "
                f"over tp={tp} x cp={cp} do not divide; use parallel.cp_form=ring or another parallel.cp")
    return None


def cp_problem(cp: int, cp_form: str, seq_len: int, n_heads: int, tp: int, sp: bool, dropout: float,
               sync: str, graphed: bool, pp: int, schedule: str) -> str | None:
    """Why this context-parallel layout cannot run (one sentence with the fix, no final stop), or None:
    the shape's split (`shape_problem`), and what cp does not compose with. Training (`check_cp`) and the
    planner (planner/states.py) refuse through this one rule."""
    if cp == 1:
        return None
    why = shape_problem(cp, cp_form, seq_len, n_heads, tp, sp)
    if why:
        return why
    if dropout:
        return (f"parallel.cp={cp} runs attention through kernels without dropout (model.dropout={dropout}); "
                "set model.dropout=0")
    if sync != "allreduce":
        return (f"parallel.sync={sync} lets replicas drift apart between averages, and cp ranks must reduce their "
                "partial gradients every step; set parallel.sync=allreduce")
    if graphed:
        return ("train.compile_mode=reduce-overhead records each block as a CUDA graph, and context-parallel "
                "attention exchanges chunks between ranks outside the graph; set train.compile_mode=default")
    if pp > 1 and schedule == "zb-h1":
        return ("parallel.schedule=zb-h1 splits each backward into an input and a weight pass, and "
                "context-parallel attention exchanges chunks in one backward; use another parallel.schedule "
                "such as 1f1b")
    return None


def check_cp(cfg) -> None:
    """Refuse, with the fix, context-parallel layouts this model or run cannot use (`cp_problem`)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    why = cp_problem(p.cp, p.cp_form, m.seq_len, m.n_heads, p.tp, p.use_sp, m.dropout, p.sync, t.cuda_graphs,
                     p.pp, p.schedule)
    if why:
        raise ConfigError(why + ".")
