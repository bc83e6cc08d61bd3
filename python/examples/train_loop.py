"""A training loop that checkpoints in the background and restarts from its newest checkpoint.

A small recommendation model in numpy: an embedding table (ids, embedding rows, Adagrad state)
and a dense MLP layer. Every K steps the loop hands the model to ``Manager.save_async``, which
copies the arrays and returns; training goes on while the checkpoint is written (full every 4
saves, deltas in between, the newest 3 kept). Then the job "crashes", a new one starts, resumes
from the newest committed step and checks that it resumed exactly where that step left off.

    python python/examples/train_loop.py [ROOT]
"""

import sys
import tempfile

import numpy as np

import saver

ROWS, DIM, BATCH, EVERY, STEPS = 50_000, 16, 512, 25, 200


class Model:
    def __init__(self, rng):
        self.ids = rng.choice(2**40, size=ROWS, replace=False).astype(np.int64)
        self.emb = (rng.standard_normal((ROWS, DIM)) * 0.01).astype(np.float32)
        self.adagrad = np.zeros((ROWS, DIM), dtype=np.float32)
        self.w = (rng.standard_normal((DIM, 1)) * 0.1).astype(np.float32)

    def step(self, rng):
        """One step of SGD with Adagrad on the touched rows of a toy regression."""
        rows = rng.integers(0, ROWS, size=BATCH)
        x = self.emb[rows]
        err = x @ self.w - 1.0
        grad_rows = err @ self.w.T / BATCH
        self.w -= 0.1 * (x.T @ err) / BATCH
        np.add.at(self.adagrad, rows, grad_rows**2)
        np.add.at(self.emb, rows, -0.5 * grad_rows / np.sqrt(self.adagrad[rows] + 1e-8))

    def tables(self):
        return {"user": {"ids": self.ids, "embedding": self.emb, "adagrad": self.adagrad}}

    def dense(self):
        return {"mlp.w": self.w}

    @classmethod
    def restored(cls, loaded):
        m = cls.__new__(cls)
        t = loaded.tables["user"]
        m.ids, m.emb, m.adagrad = t["ids"], t["embedding"], t["adagrad"]
        m.w = loaded.dense["mlp.w"]
        return m

    def state(self):
        order = np.argsort(self.ids)
        return self.ids[order], self.emb[order], self.adagrad[order], self.w.copy()


def main(root):
    rng = np.random.default_rng(7)
    manager = saver.Manager(root, full_every=4, keep_latest=3)
    model, saved = Model(rng), {}
    for step in range(1, STEPS + 1):
        model.step(rng)
        if step % EVERY == 0:
            manager.save_async(step, tables=model.tables(), dense=model.dense())
            saved[step] = model.state()  # what the checkpoint of this step must hold
    manager.wait()
    print(f"trained {STEPS} steps; committed steps: {[s['step'] for s in manager.steps()]}")

    # A new job on the same root: resume from the newest committed step.
    step, loaded = saver.Manager(root).load_latest()
    model = Model.restored(loaded)
    for want, got in zip(saved[step], model.state()):
        assert np.array_equal(want, got), "resumed state differs from the saved step"
    print(f"resumed at step {step}: the model is exactly what that step saved")
    for _ in range(10):
        model.step(rng)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d + "/run")
