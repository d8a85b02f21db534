"""How a peer pull cuts a version into requests: pieces of whole tensors, each one buffer on arrival.

Why: a range that arrives over Dask's comms lands in a buffer the comm allocated. When the range holds only
whole tensors, that buffer can *be* the tensors' memory, so the pull costs the transfer and one checksum pass,
not a second copy into a buffer laid out like a local read (on a 2-core box a 256 MB copy into fresh memory
costs about as much as reading the same bytes from the page cache). A piece is therefore a run of tensors
adjacent in their packed array, at most `max_bytes` and inside one chunk file (a range names one chunk);
a tensor that alone is larger, or that straddles a chunk boundary, is a piece of several segments, copied
into one buffer as they arrive.
"""

from __future__ import annotations

from dataclasses import dataclass

from pivotrl.gps.manifest import Manifest, TensorEntry


@dataclass(frozen=True)
class Segment:
    """Bytes [offset, offset + nbytes) of chunk file `chunk`, at `dst` in its piece's buffer."""

    chunk: int
    offset: int
    nbytes: int
    dst: int


@dataclass(frozen=True)
class Piece:
    """Tensors `entries` of packed array `array`, adjacent there: its bytes [start, start + nbytes)."""

    array: str
    start: int
    nbytes: int
    entries: tuple[TensorEntry, ...]
    segments: tuple[Segment, ...]

    @property
    def direct(self) -> bool:
        """One request: the arriving buffer is the tensors' memory."""
        return len(self.segments) == 1


def _segments(start: int, nbytes: int, chunk_bytes: int, max_bytes: int) -> tuple[Segment, ...]:
    out: list[Segment] = []
    done = 0
    while done < nbytes:
        chunk, off = divmod(start + done, chunk_bytes)
        take = min(nbytes - done, chunk_bytes - off, max_bytes)
        out.append(Segment(chunk, off, take, done))
        done += take
    return tuple(out)


def plan_pieces(manifest: Manifest, max_bytes: int, names: list[str] | None = None) -> list[Piece]:
    """The pieces holding every tensor of `manifest` (or `names`), each tensor in exactly one piece."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    tmap = manifest.tensor_map()
    amap = manifest.array_map()
    wanted = list(tmap.values()) if names is None else [tmap[n] for n in dict.fromkeys(names)]
    by_array: dict[str, list[TensorEntry]] = {}
    for e in wanted:
        by_array.setdefault(e.array, []).append(e)
    pieces: list[Piece] = []
    for aname, entries in by_array.items():
        cb = amap[aname].chunk_bytes
        entries.sort(key=lambda e: e.offset)
        run: list[TensorEntry] = []

        def close(run: list[TensorEntry] = run, aname: str = aname, cb: int = cb) -> None:
            if run:
                start = run[0].offset
                n = run[-1].offset + run[-1].nbytes - start
                pieces.append(Piece(aname, start, n, tuple(run), _segments(start, n, cb, max_bytes)))
                run.clear()

        for e in entries:
            if e.nbytes == 0:
                pieces.append(Piece(aname, e.offset, 0, (e,), ()))
                continue
            alone_fits = e.nbytes <= max_bytes and e.offset // cb == (e.offset + e.nbytes - 1) // cb
            if not alone_fits:
                close()
                run.append(e)
                close()
                continue
            if run:
                start = run[0].offset
                contiguous = run[-1].offset + run[-1].nbytes == e.offset
                same_chunk = start // cb == (e.offset + e.nbytes - 1) // cb
                if not (contiguous and same_chunk and e.offset + e.nbytes - start <= max_bytes):
                    close()
            run.append(e)
        close()
    return pieces
