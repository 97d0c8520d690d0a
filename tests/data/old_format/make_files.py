"""Writes the checkpoint files of this folder with the Python writer that embstore used
before the core wrote checkpoints (commit 20d67ab's src/embstore/_persist), and the
exports they must load as. Kept to show how the files were made; rerunning it with today's
package writes core-written files instead."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

import embstore

HERE = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)


def main() -> None:
    rng = np.random.default_rng(28)
    t = embstore.Table(
        dim=4,
        capacity=512,
        num_shards=4,
        optimizer=embstore.Adam(lr=0.1 + 0.2, weight_decay=0.01),
        initializer=embstore.Uniform(low=-0.1, high=0.1, seed=2**64 - 3),
        admission=embstore.CountFilter(min_count=2, width=1024, depth=2),
        num_threads=2,
        name="old",
        padding_id=2**64 - 1,
    )
    for _ in range(4):
        ids = rng.integers(0, 300, 200).astype(np.uint64)
        t.lookup_sum(ids, np.arange(0, 201, 10))
        t.apply_gradients(
            ids, rng.standard_normal((20, 4)).astype(np.float32), offsets=np.arange(0, 201, 10)
        )
    t.save(HERE / "table.ckpt")
    t.apply_gradients(np.arange(10, dtype=np.uint64), np.ones((10, 4), np.float32))
    t.erase(np.arange(20, 30, dtype=np.uint64))
    t.save_delta(HERE / "table.1.ckpt")
    np.savez(HERE / "table_export.npz", **t.export())
    g = embstore.TableGroup(
        {
            "a": embstore.Table(dim=3, capacity=64, optimizer=embstore.SGD(lr=0.5), num_threads=1),
            "b": embstore.Table(
                dim=2, capacity=64, optimizer=embstore.FTRL(alpha=0.1), padding_id=-1
            ),
        }
    )
    g.lookup_sum(
        {
            "a": (np.arange(20, dtype=np.uint64), np.arange(0, 21, 5)),
            "b": (np.arange(5, 30, dtype=np.uint64), np.arange(0, 26, 5)),
        }
    )
    g.save(HERE / "group")
    np.savez(
        HERE / "group_export.npz",
        **{f"{n}.{k}": v for n in g.names for k, v in g[n].export().items()},
    )
    (HERE / "spec.json").write_text(json.dumps({"step": int(t.step), "len": len(t)}))


if __name__ == "__main__":
    main()
