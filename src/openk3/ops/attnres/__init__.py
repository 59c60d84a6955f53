"""Block Attention Residuals (SPEC.md §3).

The model walks its layers with a *reader* object that holds the sealed block summaries:
``reader.seal(r, sites)`` appends the running sum ``r`` as a sealed source and announces the read sites that will
read this sealed set (``sites``: list of ``(site_id, query [1,D], norm_weight [D])``), so a fast backend can score
all of them against the sealed blocks in one batched pass (phase 1); ``reader.read(site_id, query, norm_weight, r)``
then mixes the sealed sources with the live partial sum ``r`` (phase 2). The reference reader recomputes everything
at each read.
"""

from openk3.ops.attnres.reference import AttnResReader, attnres_read

# Fast readers registered by GPU backends: name -> class with the AttnResReader interface
FAST_READERS: dict[str, type] = {}

__all__ = ["attnres_read", "AttnResReader", "FAST_READERS", "make_reader"]


def make_reader(eps: float, is_cuda: bool, requested: str | None = None, max_sources: int | None = None):
    """The reader of the resolved backend; ``max_sources`` (the number of sealed sets one forward will create) lets a
    fast reader size its source buffer once."""
    from openk3.ops import backend as _backend

    be = _backend.resolve("attnres", is_cuda, requested)
    cls = AttnResReader if be == "reference" else FAST_READERS[be]
    return cls(eps, max_sources=max_sources)
