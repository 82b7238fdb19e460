"""The data-parallel ranks behind one engine link, and which rank gets a request.

``vllm serve --headless --data-parallel-size N`` is one launch that runs N
engine cores, each dialling the front end's handshake socket with its own
identity (the rank, 2 bytes little-endian) and serving requests sent to that
identity on the front end's one input ROUTER; all N push outputs to the one
output PULL, each frame naming its ``engine_index``. enginelink is that front
end, so it does what vLLM's DP front end does with the ranks:

- a request pinned with ``data_parallel_rank`` goes to that rank (the pin is
  checked against ``[0, N)`` before admission, vLLM's rule and words);
- an unpinned request goes to the least-loaded rank, by vLLM 0.32's
  ``DPLBAsyncMPClient.get_core_engine_for_request``: the score of a rank is
  ``max(client_count x in-flight, coordinator waiting + running)`` (plus a KV
  penalty on waiting), scanned from a start index that moves on by one after
  every unpinned pick, the first lowest score winning. enginelink is the
  only client of its engines and runs no DP coordinator (a headless engine
  of a dense model needs none), so the coordinator's counts could only
  restate ours: the score here is the exact in-flight count, and the
  rotating start makes ties (an idle engine) go round-robin, as vLLM's do;
- an abort goes to the rank that holds the request (the hub keeps each
  choice's rank); every engine request's end releases its rank's count.

Sans-io: no clock, no I/O. The rank numbers are set once the handshake
names them (``set_ranks``); before that the table is empty and ``pick``
answers rank 0 (admission is closed until the handshake anyway).
"""

from __future__ import annotations


class RankTable:
    """In-flight engine requests per rank, and the least-loaded choice between them."""

    def __init__(self, ranks: tuple[int, ...] = ()) -> None:
        self.in_flight: dict[int, int] = {}
        self.sent: dict[int, int] = {}  # engine requests ever sent per rank (metrics, inspect)
        self._order: tuple[int, ...] = ()
        self._start = 0
        self.set_ranks(ranks)

    def set_ranks(self, ranks: tuple[int, ...]) -> None:
        self._order = tuple(sorted(ranks))
        self.in_flight = {rank: self.in_flight.get(rank, 0) for rank in self._order}
        self.sent = {rank: self.sent.get(rank, 0) for rank in self._order}
        self._start = 0

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._order

    @property
    def size(self) -> int:
        """How many ranks serve (the ``N`` of a pin's ``[0, N)``); 1 before the handshake."""
        return len(self._order) or 1

    def pick(self, pinned: int | None = None) -> int:
        """The rank the next engine request goes to, counted as in flight there."""
        order = self._order
        if not order:
            return 0 if pinned is None else pinned
        if pinned is not None:
            # A pin is a place in [0, N), checked before admission: the rank itself when ranks start at 0.
            rank = order[pinned] if 0 <= pinned < len(order) else pinned
        else:
            best = None
            count = len(order)
            for step in range(count):
                candidate = order[(self._start + step) % count]
                score = self.in_flight[candidate]
                if best is None or score < best[0]:
                    best = (score, candidate)
            rank = best[1]
            self._start = (self._start + 1) % count
        self.in_flight[rank] = self.in_flight.get(rank, 0) + 1
        self.sent[rank] = self.sent.get(rank, 0) + 1
        return rank

    def ended(self, rank: int) -> None:
        """One engine request on ``rank`` ended (finished, aborted, failed, never sent)."""
        if self.in_flight.get(rank, 0) > 0:
            self.in_flight[rank] -= 1

    def snapshot(self) -> dict[int, dict[str, int]]:
        return {rank: {"in_flight": self.in_flight[rank], "sent": self.sent[rank]} for rank in self._order}
