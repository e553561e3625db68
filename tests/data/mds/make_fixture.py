"""Writes this folder's MDS fixture with MosaicML Streaming's own MDSWriter (see README.md: run in a throwaway
virtual environment, never by the tests)."""
import os
import sys

import numpy as np
from streaming import MDSWriter

here = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(55)
documents = [rng.integers(3, 320, size=int(rng.integers(1, 90)), dtype=np.uint16) for _ in range(60)]
for k in (5, 17, 59):   # a few documents that already end with eos (id 2): it must not be doubled
    documents[k][-1] = 2
# two columns around the tokens (one fixed-size, one variable-size) so that the reader must skip both; a small
# size_limit so that the set spans several shard files
columns = {"id": "int", "text": "str", "tokens": "ndarray:uint16"}
with MDSWriter(out=os.path.join(here, "set"), columns=columns, size_limit=2048) as out:
    for i, doc in enumerate(documents):
        out.write({"id": i, "text": f"document {i}", "tokens": doc})
np.savez(os.path.join(here, "source.npz"), tokens=np.concatenate(documents),
         lengths=np.array([len(d) for d in documents]))
print("wrote", os.path.join(here, "set"), file=sys.stderr)
