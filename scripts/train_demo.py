"""Train the demo V4.1 (v41_jax/configs/demo.config.json) on the corpus of `scripts.demo_data`,
then export it in the published checkpoint format.

    python -m scripts.train_demo --data build/demo_data --work DIR --lm-seconds 300 --draft-seconds 90
    python -m scripts.train_demo --data build/demo_data --work DIR --export models/demo --metadata models/demo
    python -m scripts.train_demo --data build/demo_data --work DIR --init-from models/demo --fresh-drafts \
        --draft-seconds 110 --draft-data-seconds 80 --draft-sequences 65536 --draft-gen-batch 2048
        (the draft stages alone, trained again on the shipped target; without --fresh-drafts they
        continue from the shipped stages)

The model is the project's own: `model.forward.forward` for the backbone, `model.dspark.draft` for
the draft stages; the parameters are the params pytree `checkpoint.load_params` builds, in fp32,
initialised by `scripts.make_checkpoint.random_weights` and exported by its `encode`. What
inference has and training needs differently:

  * Engram tables live on the host at inference; here they are trainable device arrays
    (`params["engram"]`), and the hash ids are computed on the host by `EngramHasher` once per
    training window, the rows gathered inside the jitted step.
  * Selections (index top-k, candidate blocks, MoE top-k) pass no gradient: the selected rows /
    experts are trained through the attention / routing weights they feed, the indexer's own
    weights get none (they keep their initialisation; no weight decay on them either).
    The MoE gate bias steers selection only, so it is not trained by gradient but balanced as in
    DeepSeek's aux-loss-free routing: bias += rate * sign(mean load - expert load) every step.
  * Routed experts run through the all-experts dense path of `kernels_pallas.moe` (differentiable,
    exact); the other kernels take their XLA (jnp) path.
  * Quantization: the backbone trains in fp32 (`Numerics.fp32()`) with fp32 master weights; the
    last `--qat-fraction` of the LM phase is quantization-aware with the straight-through
    estimator: the loss and its gradients are taken at the weights rounded to their published
    formats (FP8 32x32 blocks, FP4 experts, BF16, FP8 Engram rows) and applied to the masters.
    The backbone's activations stay fp32; the export's cost in perplexity is measured, not assumed.
  * DSpark stages (phase "draft", target frozen): self-distillation. Training prefixes (PREFIX
    tokens at random offsets) are continued greedily by the target, --draft-gen-batch at a time
    for --draft-data-seconds; every anchor inside a continuation is a draft example whose labels
    are the target's next `dspark_block_size` greedy tokens (Markov chain teacher forced on them:
    with every earlier draft right, the model's own chain is that one), the confidence head
    learning whether each draft is right. The whole phase runs under --draft-numerics (default
    the engine's default, "fast": bf16 activations, FP8 activation fake-quant): the target's
    continuations and taps are the ones the engine's target computes, and the stages learn at the
    numerics they are run at (the fake-quant's rounding is straight-through, `quant._qdq`). The
    stages' weights are quantization-aware throughout: loss and gradients at their published
    formats, applied to fp32 masters (as the backbone's QAT phase). Measured on the held-out
    documents' continuations: per position the agreement, the accepted prefix and the tokens per
    verify step it implies.

Each phase resumes from its latest orbax checkpoint (DIR/ckpt_lm, DIR/ckpt_draft: step, seconds
spent, optimizer state); budgets are in seconds, and the learning rate follows the fraction of
its budget spent, so an interrupted run continues its schedule. DIR/log.json holds the loss log.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from pathlib import Path

import numpy as np

CONFIG = Path(__file__).resolve().parent.parent / "v41_jax/configs/demo.config.json"
SEQ = 256           # LM training window (the config's max_position_embeddings is 512)
PREFIX, CONT = 64, 64   # draft data: data prefix, then the target's greedy continuation
BIAS_RATE = 1e-3    # gate-bias balancing step
WALL_RESERVE = 150  # seconds of --wall-seconds kept for compiles, evaluations and saves outside the budgets


# ---- params: the loader's pytree layout, fp32 -------------------------------------------------
def init_params(cfg, seed: int) -> dict:
    """{"model": load_params' layout in fp32 (no host tables), "engram": {layer: table [rows, hd]}}."""
    from scripts.make_checkpoint import random_weights
    from v41_jax.checkpoint.load import nest, param_units
    from v41_jax.checkpoint.schema import checkpoint_schema

    schema = checkpoint_schema(cfg)
    w = random_weights(schema, seed)
    flat = {path: np.stack([w[n] for n in u.names]) if u.stacked else w[u.names[0]]
            for path, u in param_units(schema).items()}
    return {"model": nest(flat),
            "engram": {str(l): w[f"layers.{l}.engram.embed.weight"] for l in cfg.engram_layer_ids}}


def _leaf(tree, path: str):
    for key in path.split("."):
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
    return tree


def named_weights(cfg, params: dict) -> dict[str, np.ndarray]:
    """The inverse of `init_params`: stored-tensor name -> fp32 values (experts unstacked)."""
    from v41_jax.checkpoint.load import param_units
    from v41_jax.checkpoint.schema import checkpoint_schema

    out = {}
    for path, u in param_units(checkpoint_schema(cfg)).items():
        leaf = np.asarray(_leaf(params["model"], path), np.float32)
        out.update({n: leaf[i] for i, n in enumerate(u.names)} if u.stacked else {u.names[0]: leaf})
    for l, table in params["engram"].items():
        out[f"layers.{l}.engram.embed.weight"] = np.asarray(table, np.float32)
    return out


def published_formats(cfg, params: dict) -> dict:
    """A pytree like `params` naming each leaf's stored format: "fp8" (32x32 blocks), "fp4"
    (expert rows), "rows" (Engram FP8 rows), "bf16" or "f32"."""
    from v41_jax.checkpoint.load import nest, param_units
    from v41_jax.checkpoint.schema import checkpoint_schema

    schema = checkpoint_schema(cfg)
    kind = {"F8_E4M3": "fp8", "I8": "fp4", "BF16": "bf16", "F32": "f32"}
    flat = {path: kind[schema[u.names[0]].dtype] for path, u in param_units(schema).items()}
    return {"model": nest(flat), "engram": {l: "rows" for l in params["engram"]}}


def round_to_formats(tree, formats):
    """Every weight of `tree` rounded to its format in `formats` (a pytree of the same structure
    naming them): the values the exported checkpoint holds."""
    import jax
    import jax.numpy as jnp

    from v41_jax import quant

    def qdq(w, fmt):
        if fmt == "fp8":
            q = quant.dequant_fp8_blocks(*quant.quant_weight_fp8(w), dtype=jnp.float32)
        elif fmt == "fp4":
            q = jax.vmap(lambda e: quant.dequant_fp4_rows(*quant.quant_weight_fp4(e), dtype=jnp.float32))(w)
        elif fmt == "rows":
            q = quant.dequant_fp8_rows(*quant.quant_fp8_ue8m0(w), dtype=jnp.float32)
        elif fmt == "bf16":
            q = w.astype(jnp.bfloat16).astype(jnp.float32)
        else:
            return w
        return q

    return jax.tree.map(qdq, tree, formats)


def fake_quant_weights(params: dict, formats: dict) -> dict:
    """`params` (the whole model or the backbone alone) at their published formats."""
    return round_to_formats(params, {"model": {k: formats["model"][k] for k in params["model"]},
                                     "engram": formats["engram"]})


@contextlib.contextmanager
def training_kernels():
    """Differentiable kernel paths: jnp everywhere, routed experts through the dense all-experts
    GEMM (the XLA reference loop gathers a weight copy per token, too big to differentiate at
    training batch sizes). Scoped to training: inference keeps the dispatcher's choice."""
    from kernels_pallas import backend
    from kernels_pallas import moe as kernel_moe

    routed = kernel_moe.routed_experts
    kernel_moe.routed_experts = functools.partial(routed, backend="pallas", impl="dense")
    try:
        with backend.use_backend("xla"):
            yield
    finally:
        kernel_moe.routed_experts = routed


# ---- data ------------------------------------------------------------------------------------
def windows(stream: np.ndarray, length: int, offset: int = 0) -> np.ndarray:
    """Non-overlapping windows of `length` tokens starting at `offset` -> int32 [N, length]."""
    n = (len(stream) - offset) // length
    return stream[offset: offset + n * length].reshape(n, length).astype(np.int32)


def engram_ids(hasher, tokens: np.ndarray) -> np.ndarray:
    """Hash ids of each window as a sequence from position 0 -> int32 [N, S, nE, cols]."""
    return np.stack([hasher.hash_ids(hasher.start(), seq)[0] for seq in tokens]).astype(np.int32)


def rows_of(params: dict, cfg, ids):
    """Engram rows gathered from the trainable tables -> {layer: [B, S, cols, hd]}."""
    return {l: params["engram"][str(l)][ids[:, :, i]] for i, l in enumerate(cfg.engram_layer_ids)}


# ---- losses ------------------------------------------------------------------------------------
def lm_logits(params, cfg, tokens, ids, numerics, intermediates=False):
    from v41_jax.model.forward import forward

    return forward(params["model"], cfg, tokens, numerics=numerics, engram_rows=rows_of(params, cfg, ids),
                   return_intermediates=intermediates)


def token_nll(logits, targets):
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def draft_loss(mtp, frozen, cfg, ctx_hidden, anchors, tokens, numerics):
    """ctx_hidden [B, S, nT*D] (the frozen target's taps), anchors [B, A], tokens [B, S] ->
    (loss, right [B*A, blk]: 1.0 where a draft equals its label). Labels: the tokens after anchor + 1 (the target's greedy
    continuation); the Markov chain is teacher-forced on them."""
    import jax
    import jax.numpy as jnp
    import optax

    from v41_jax.model.dspark import context_x, draft

    blk = cfg.dspark_block_size
    params = {**frozen, "mtp": mtp}
    a = anchors.shape[1]
    ctx = jnp.repeat(context_x(params, cfg, ctx_hidden, numerics), a, axis=0)      # [B*A, S, D]
    anchor = anchors.reshape(-1)
    seq = jnp.repeat(tokens, a, axis=0)
    follow = jnp.take_along_axis(seq, anchor[:, None] + 1 + jnp.arange(blk + 1), axis=1)  # [B*A, blk+1]
    out = draft(params, cfg, ctx, anchor, follow[:, 0], numerics, forced_prev=follow[:, :-1])
    labels = follow[:, 1:]
    nll = token_nll(out.logits, labels)
    right = (jnp.argmax(out.logits, -1) == labels).astype(jnp.float32)
    conf = jnp.mean(optax.sigmoid_binary_cross_entropy(out.confidence, jax.lax.stop_gradient(right)))
    return jnp.mean(nll) + 0.1 * conf, right


def acceptance(right: np.ndarray) -> dict:
    """Per-example draft hits [N, blk] (the chain teacher-forced on the target's tokens) -> per
    position: agreement (each position on its own), accepted (the first k drafts all right: what
    greedy verification accepts, since with all earlier drafts right the model's own chain is the
    teacher-forced one), and the tokens per verify step that implies (1 + accepted drafts)."""
    right = np.asarray(right, np.float64)
    accepted = np.cumprod(right, axis=1)
    return {"agree": np.round(right.mean(0), 3).tolist(), "accepted": np.round(accepted.mean(0), 3).tolist(),
            "tokens_per_verify": round(float(1 + accepted.sum(1).mean()), 3)}


# ---- the trainer -----------------------------------------------------------------------------
class Trainer:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp
        from tokenizers import Tokenizer

        from v41_jax.config import ModelConfig, validate
        from v41_jax.engram_hash import EngramHasher, token_map_from_tokenizer
        from v41_jax.numerics import Numerics
        from v41_jax.runtime.engine import NUMERICS

        self.args = args
        self.t_begin = time.time()
        self.cfg = ModelConfig.from_file(args.config)
        validate(self.cfg)
        self.tokenizer = Tokenizer.from_file(os.path.join(args.data, "tokenizer.json"))
        self.token_map = token_map_from_tokenizer(self.tokenizer, self.cfg.engram_compressed_vocab_size)
        self.hasher = EngramHasher(self.cfg, self.token_map)
        self.fp32 = Numerics.fp32()
        self.draft_numerics = NUMERICS[args.draft_numerics]()
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = json.loads((self.work / "log.json").read_text()) if (self.work / "log.json").exists() \
            else {"lm": [], "eval": [], "draft": [], "result": {}}
        self.rng = np.random.default_rng(args.seed)
        train = np.load(os.path.join(args.data, "train.npy"))
        held = np.load(os.path.join(args.data, "heldout.npy"))
        # two window grids over the stream (offsets 0 and SEQ/2) for some variety across epochs
        self.train_tokens = np.concatenate([windows(train, SEQ + 1, 0), windows(train, SEQ + 1, SEQ // 2)])
        if args.max_windows:   # a small run (debugging on CPU)
            self.train_tokens = self.train_tokens[self.rng.permutation(len(self.train_tokens))[:args.max_windows]]
        self.eval_tokens = windows(held, SEQ + 1)[:args.eval_windows]
        t0 = time.time()
        self.train_ids = engram_ids(self.hasher, self.train_tokens[:, :-1])
        self.eval_ids = engram_ids(self.hasher, self.eval_tokens[:, :-1])
        print(f"data: {len(self.train_tokens)} train / {len(self.eval_tokens)} eval windows of {SEQ + 1}, "
              f"hashed in {time.time() - t0:.1f}s", flush=True)
        self.params = jax.tree.map(jnp.asarray, init_params(self.cfg, args.seed))
        self.formats = published_formats(self.cfg, self.params)
        self._eval = self._quantize = self._greedy = None

    # -- optimizers: one per phase; weight decay on matrices that get gradients
    def _optimizer(self, lr: float):
        import optax

        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.inject_hyperparams(optax.adamw)(learning_rate=lr, b1=0.9, b2=0.95,
                                                                 weight_decay=0.1, mask=self._mask))

    @staticmethod
    def _decays(path, leaf) -> bool:
        names = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if "indexer" in names or leaf.ndim < 2:      # indexer: no gradient, keep it as initialised
            return False
        return not any(isinstance(n, str) and n.startswith("hc_") for n in names)

    def _mask(self, tree):
        import jax

        return jax.tree_util.tree_map_with_path(self._decays, tree)

    # -- orbax
    def _manager(self, name):
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(self.work.resolve() / name, options=ocp.CheckpointManagerOptions(max_to_keep=1))

    def _save(self, mgr, step, state):
        import orbax.checkpoint as ocp

        mgr.save(step, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()

    def _restore(self, mgr, template):
        import orbax.checkpoint as ocp

        step = mgr.latest_step()
        if step is None:
            return None
        return mgr.restore(step, args=ocp.args.StandardRestore(template))

    def _lr(self, peak: float, frac: float) -> float:
        """Linear warm-up over the first 3 % of the budget, cosine to 10 % of peak."""
        if frac < 0.03:
            return peak * frac / 0.03
        return peak * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, (frac - 0.03) / 0.97))))

    # -- phase 1: the backbone
    def quantized(self, params: dict) -> dict:
        """`params` as the published checkpoint stores them (the QAT weights)."""
        import jax

        if self._quantize is None:
            self._quantize = jax.jit(lambda p: fake_quant_weights(p, self.formats))
        return self._quantize(params)

    def lm_step_fn(self):
        """One step: gradients at `at` (the weights themselves, or their published form in the QAT
        phase: the straight-through estimator), applied to the fp32 `trained`."""
        import jax
        import jax.numpy as jnp
        import optax

        cfg, numerics = self.cfg, self.fp32

        def loss_fn(at, mtp, tokens, ids):
            params = {"model": {**at["model"], "mtp": mtp}, "engram": at["engram"]}
            logits, inter = lm_logits(params, cfg, tokens[:, :-1], ids, numerics, True)
            return jnp.mean(token_nll(logits, tokens[:, 1:])), inter["gate_topk"]

        @jax.jit
        def step(trained, at, mtp, opt_state, tokens, ids):
            (loss, picks), grads = jax.value_and_grad(loss_fn, has_aux=True)(at, mtp, tokens, ids)
            updates, opt_state = self.lm_opt.update(grads, opt_state, trained)
            trained = optax.apply_updates(trained, updates)
            layers = list(trained["model"]["layers"])
            for layer, idx in picks.items():   # aux-loss-free balancing of the gate bias
                n_exp = layers[layer]["ffn"]["gate"]["bias"].shape[0]
                load = jnp.bincount(idx.reshape(-1), length=n_exp).astype(jnp.float32)
                ffn = layers[layer]["ffn"]
                bias = ffn["gate"]["bias"] + BIAS_RATE * jnp.sign(jnp.mean(load) - load)
                layers[layer] = {**layers[layer], "ffn": {**ffn, "gate": {**ffn["gate"], "bias": bias}}}
            trained = {**trained, "model": {**trained["model"], "layers": layers}}
            return trained, opt_state, loss, optax.global_norm(grads)

        return step

    def held_ppl(self, params) -> float:
        """Perplexity of the held-out windows under the training numerics (fp32)."""
        import jax
        import jax.numpy as jnp

        if self._eval is None:
            cfg, numerics = self.cfg, self.fp32
            self._eval = jax.jit(lambda p, t, i: jnp.sum(token_nll(lm_logits(p, cfg, t[:, :-1], i, numerics), t[:, 1:])))
        total, count, bs = 0.0, 0, 8
        for i in range(0, len(self.eval_tokens), bs):
            total += float(self._eval(params, self.eval_tokens[i:i + bs], self.eval_ids[i:i + bs]))
            count += self.eval_tokens[i:i + bs, 1:].size
        return float(np.exp(total / count))

    def split(self):
        model = dict(self.params["model"])
        mtp = model.pop("mtp")
        return {"model": model, "engram": self.params["engram"]}, mtp

    def train_lm(self, seconds: float):
        import jax
        import jax.numpy as jnp

        trained, mtp = self.split()
        self.lm_opt = self._optimizer(self.args.lr)
        state = {"trained": trained, "opt": self.lm_opt.init(trained), "step": 0, "spent": 0.0}
        mgr = self._manager("ckpt_lm")
        state = self._restore(mgr, state) or state
        step, spent = int(state["step"]), float(state["spent"])
        trained, opt_state = state["trained"], state["opt"]
        qat_from = (1 - self.args.qat_fraction) * seconds
        step_fn, bs, seen = self.lm_step_fn(), self.args.batch, set()
        last = t_save = time.time()
        while spent < seconds:
            qat = spent >= qat_from
            first = qat not in seen
            seen.add(qat)
            opt_state[1].hyperparams["learning_rate"] = jnp.asarray(self._lr(self.args.lr, spent / seconds), jnp.float32)
            pick = self.rng.integers(0, len(self.train_tokens), bs)
            at = self.quantized(trained) if qat else trained
            trained, opt_state, loss, gnorm = step_fn(trained, at, mtp, opt_state, self.train_tokens[pick],
                                                      self.train_ids[pick])
            step += 1
            if first:   # compile time is not training time
                jax.block_until_ready(loss)
                print(f"lm step (qat={qat}) compiled and ran in {time.time() - last:.1f}s", flush=True)
                last = time.time()
                if self.args.wall_seconds and not qat:   # fit the schedule to the wall-clock left
                    left = self.args.wall_seconds - (last - self.t_begin) - self.args.draft_seconds - WALL_RESERVE
                    if left < seconds:
                        print(f"lm budget {seconds:.0f}s -> {left:.0f}s to end within --wall-seconds", flush=True)
                        seconds = max(left, spent + 1.0)
                        qat_from = (1 - self.args.qat_fraction) * seconds
            spent += time.time() - last
            last = time.time()
            if step % 25:
                continue
            loss = float(loss)
            self.log["lm"].append({"step": step, "seconds": round(spent, 1), "loss": round(loss, 4),
                                   "grad_norm": round(float(gnorm), 3), "qat": qat,
                                   "lr": float(opt_state[1].hyperparams["learning_rate"]),
                                   "tokens": step * bs * SEQ})
            if step % self.args.eval_every == 0:
                ppl = self.held_ppl(self.quantized(trained) if qat else trained)
                self.log["eval"].append({"step": step, "seconds": round(spent, 1), "heldout_ppl": round(ppl, 3)})
                print(f"step {step} {spent:.0f}s loss {loss:.3f} held-out ppl {ppl:.2f}", flush=True)
            if time.time() - t_save > 60:
                self._save(mgr, step, {"trained": trained, "opt": opt_state, "step": step, "spent": spent})
                self._write_log()
                t_save = time.time()
            last = time.time()   # evaluation and saving are not training time
        jax.block_until_ready(trained)
        self._save(mgr, step, {"trained": trained, "opt": opt_state, "step": step, "spent": spent})
        self.params = {"model": {**trained["model"], "mtp": mtp}, "engram": trained["engram"]}

    # -- phase 2: the draft stages on the frozen target
    def greedy_fns(self):
        """(next_token(target, tokens, ids, pos) -> the target's greedy token after `pos` [B],
        taps(target, tokens, ids) -> its taps [B, S, nT*D]), jitted, the draft phase's numerics. next_token
        applies the head to row `pos` alone (the other rows' logits are dead code to XLA)."""
        import jax
        import jax.numpy as jnp

        from v41_jax.model.head import lm_head

        cfg, numerics = self.cfg, self.draft_numerics

        @jax.jit
        def next_token(target, tokens, ids, pos):
            normed = lm_logits(target, cfg, tokens, ids, numerics, True)[1]["final_normed"][:, pos]
            return jnp.argmax(lm_head(target["model"]["head"]["weight"], normed), -1).astype(jnp.int32)

        @jax.jit
        def taps(target, tokens, ids):
            return lm_logits(target, cfg, tokens, ids, numerics, True)[1]["main_hidden"]
        return next_token, taps

    def continue_greedily(self, target, prefixes: np.ndarray):
        """Up to --draft-gen-batch prefixes [n, >= PREFIX] (their first PREFIX tokens) continued
        greedily by `target` for CONT tokens -> (tokens int32 [n, PREFIX + CONT], the target's taps
        on them [n, PREFIX + CONT, nT*D], on the device). Every call runs --draft-gen-batch rows (the
        prefixes repeated to fill it): one compiled shape. Engram ids are hashed on the host: the
        prefix once per sequence, then each new token of all sequences in one call (the rows after
        `pos` are never read by a causal forward at `pos`, so they stay 0 until filled)."""
        cfg, g, n = self.cfg, self.args.draft_gen_batch, len(prefixes)
        if n > g:
            raise ValueError(f"{n} prefixes exceed --draft-gen-batch {g}")
        self._greedy = self._greedy or self.greedy_fns()
        next_token, taps = self._greedy
        seqs = np.zeros((g, PREFIX + CONT), np.int32)
        seqs[:, :PREFIX] = np.resize(prefixes[:, :PREFIX], (g, PREFIX))
        ids = np.zeros((g, PREFIX + CONT, len(cfg.engram_layer_ids), cfg.engram_hash_cols), np.int32)
        cursors = []
        for i, seq in enumerate(seqs[:, :PREFIX]):
            ids[i, :PREFIX], cursor = self.hasher.hash_ids(self.hasher.start(), seq)
            cursors.append(cursor.as_row())
        cursors = np.stack(cursors)
        for pos in range(PREFIX - 1, PREFIX + CONT - 1):
            seqs[:, pos + 1] = np.asarray(next_token(target, seqs, ids, pos))
            ids[:, pos + 1], cursors = self.hasher.next_token_ids(cursors, seqs[:, pos + 1])
        return seqs[:n], taps(target, seqs, ids)[:n]

    def draft_data(self, target, prefixes: np.ndarray, seconds: float):
        """Greedy continuations of `prefixes` a --draft-gen-batch at a time, stopping at the first
        batch boundary after `seconds` (0: all) -> (tokens [m, PREFIX + CONT], taps), on the device."""
        import jax.numpy as jnp

        t0, tokens, taps = time.time(), [], []
        for start in range(0, len(prefixes), self.args.draft_gen_batch):
            seqs, hidden = self.continue_greedily(target, prefixes[start: start + self.args.draft_gen_batch])
            tokens.append(seqs)
            taps.append(hidden)
            if seconds and time.time() - t0 >= seconds:
                break
        return jnp.asarray(np.concatenate(tokens)), jnp.concatenate(taps)

    def train_draft(self, seconds: float):
        import jax
        import jax.numpy as jnp
        import optax

        # the target as it ships (published weights) at the engine's numerics: the drafts chase
        # its greedy tokens, from its taps
        cfg, numerics, args = self.cfg, self.draft_numerics, self.args
        target = self.quantized(self.params)
        shipped = jax.jit(lambda m: round_to_formats(m, self.formats["model"]["mtp"]))   # the stages as exported
        frozen = {k: v for k, v in target["model"].items() if k != "mtp"}
        mtp = self.params["model"]["mtp"]
        opt = self._optimizer(args.draft_lr)
        state = {"mtp": mtp, "opt": opt.init(mtp), "step": 0, "spent": 0.0}
        mgr = self._manager("ckpt_draft")
        state = self._restore(mgr, state) or state
        mtp, opt_state, step, spent = state["mtp"], state["opt"], int(state["step"]), float(state["spent"])
        lo, hi = PREFIX - 1, PREFIX + CONT - cfg.dspark_block_size - 2   # anchors whose labels are all greedy

        # held out: the held-out documents' prefixes (the demo_eval grid), continued by the target
        t0 = time.time()
        held_prefixes = windows(np.load(os.path.join(args.data, "heldout.npy")), SEQ + 1, SEQ // 2)
        held_seqs, held_hidden = self.draft_data(target, held_prefixes[:args.draft_held], 0)
        n_train = -(-args.draft_sequences // args.draft_gen_batch) * args.draft_gen_batch
        rows, starts = (self.rng.integers(0, hi_, n_train) for hi_ in (len(self.train_tokens), SEQ + 2 - PREFIX))
        prefixes = self.train_tokens[rows[:, None], starts[:, None] + np.arange(PREFIX)]   # any offset: all distinct
        seqs, hidden = self.draft_data(target, prefixes, args.draft_data_seconds)
        print(f"draft data: {len(seqs)} training and {len(held_seqs)} held-out continuations in "
              f"{time.time() - t0:.1f}s", flush=True)

        @jax.jit
        def step_fn(mtp, opt_state, frozen, hidden, anchors, tokens):
            # quantization-aware (straight-through): the gradients at the published weights, applied
            # to the fp32 masters
            (loss, right), grads = jax.value_and_grad(draft_loss, has_aux=True)(
                shipped(mtp), frozen, cfg, hidden, anchors, tokens, numerics)
            updates, opt_state = opt.update(grads, opt_state, mtp)
            return optax.apply_updates(mtp, updates), opt_state, loss, jnp.mean(right, 0)

        held_fn = jax.jit(lambda m, f, h, a, t: draft_loss(shipped(m), f, cfg, h, a, t, numerics)[1])
        chunk = min(32, len(held_seqs))             # held-out sequences per call (all their anchors)
        anchors_all = np.tile(np.arange(lo, hi + 1, dtype=np.int32), (chunk, 1))

        def held_out(mtp) -> dict:
            right = np.concatenate([np.asarray(held_fn(mtp, frozen, held_hidden[i: i + chunk], anchors_all,
                                                       held_seqs[i: i + chunk]))
                                    for i in range(0, len(held_seqs) - chunk + 1, chunk)])
            return acceptance(right)

        if step == 0:
            self.log["draft_held_before"] = held_out(mtp)
            print(f"draft stages before: held-out {self.log['draft_held_before']}", flush=True)
        b, a = args.draft_batch, args.draft_anchors
        last = time.time()
        while spent < seconds:
            opt_state[1].hyperparams["learning_rate"] = jnp.asarray(self._lr(args.draft_lr, spent / seconds),
                                                                    jnp.float32)
            pick = jnp.asarray(self.rng.integers(0, len(seqs), b))
            anchors = self.rng.integers(lo, hi + 1, (b, a)).astype(np.int32)
            mtp, opt_state, loss, agree = step_fn(mtp, opt_state, frozen, hidden[pick], anchors, seqs[pick])
            step += 1
            if step == 1:   # compile time is not training time
                jax.block_until_ready(loss)
                last = time.time()
            spent += time.time() - last
            last = time.time()
            if step % args.draft_eval_every == 0 or spent >= seconds:
                held = held_out(mtp)
                self.log["draft"].append({"step": step, "seconds": round(spent, 1), "loss": round(float(loss), 4),
                                          "numerics": args.draft_numerics,
                                          "examples": step * b * a,
                                          "train_agree": [round(float(x), 3) for x in agree],
                                          "held_agree": held["agree"], "held_accepted": held["accepted"],
                                          "held_tokens_per_verify": held["tokens_per_verify"]})
                print(f"draft step {step} {spent:.0f}s loss {float(loss):.3f} held-out agree {held['agree']} "
                      f"tokens/verify {held['tokens_per_verify']}", flush=True)
                last = time.time()
        self._save(mgr, step, {"mtp": mtp, "opt": opt_state, "step": step, "spent": spent})
        self.log["result"].update(draft_train_continuations=len(seqs), draft_held_continuations=len(held_seqs),
                                  draft_steps=step, draft_examples=step * b * a, draft_numerics=args.draft_numerics)
        self.params = {"model": {**frozen, "mtp": mtp}, "engram": self.params["engram"]}

    def _write_log(self):
        (self.work / "log.json").write_text(json.dumps(self.log, indent=1))

    def save_params(self):
        """The trained fp32 weights by stored-tensor name (what `--export` encodes)."""
        np.savez(self.work / "weights.npz", **named_weights(self.cfg, self.params))


def export(cfg_path: str, weights_npz: str, out: str, shards: int = 2) -> None:
    """fp32 weights -> the published shards (make_checkpoint's encoder and writer; two shards keep
    each file under 16 MB)."""
    from scripts.make_checkpoint import encode
    from v41_jax.checkpoint.safetensors_io import write_checkpoint
    from v41_jax.checkpoint.schema import checkpoint_schema
    from v41_jax.config import ModelConfig, validate

    cfg = ModelConfig.from_file(cfg_path)
    validate(cfg)
    os.makedirs(out, exist_ok=True)
    write_checkpoint(out, encode(checkpoint_schema(cfg), dict(np.load(weights_npz))), shards)


def write_metadata(cfg_path: str, data: str, out: str) -> None:
    """What sits beside the shards: config.json, the tokenizer, its Engram token map, the aliases."""
    import shutil

    from tokenizers import Tokenizer

    from scripts.make_checkpoint import hf_root_config
    from v41_jax.checkpoint.schema import parameter_aliases
    from v41_jax.config import ModelConfig, validate
    from v41_jax.engram_hash import token_map_from_tokenizer

    raw = json.loads(Path(cfg_path).read_text())
    cfg = ModelConfig.from_dict(raw)
    validate(cfg)
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(data, "tokenizer.json"), os.path.join(out, "tokenizer.json"))
    token_map = token_map_from_tokenizer(Tokenizer.from_file(os.path.join(out, "tokenizer.json")),
                                         cfg.engram_compressed_vocab_size)
    for fname, obj in (("config.json", hf_root_config(raw, cfg)),
                       ("engram_token_map.json", token_map.tolist()),
                       ("parameter_aliases.json", parameter_aliases(cfg))):
        with open(os.path.join(out, fname), "w") as f:
            json.dump(obj, f, indent=1)


def plot_log(log_json: str, png: str) -> None:
    """The loss curves of a log.json: LM training loss and held-out perplexity, draft agreement."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = json.loads(Path(log_json).read_text())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["tokens"] / 1e6 for r in log["lm"]], [r["loss"] for r in log["lm"]], lw=0.8, label="train loss")
    lm_tokens = {r["step"]: r["tokens"] for r in log["lm"]}
    ax1.plot([lm_tokens[r["step"]] / 1e6 for r in log["eval"]], [np.log(r["heldout_ppl"]) for r in log["eval"]],
             "o-", label="held-out loss")
    qat = [r["tokens"] / 1e6 for r in log["lm"] if r["qat"]]
    if qat:
        ax1.axvspan(qat[0], qat[-1], color="0.9", label="QAT (published weights)")
    ax1.set(xlabel="tokens (M)", ylabel="nats / token", title="backbone", ylim=(1, 8))
    ax1.legend()
    for k in range(len(log["draft"][0]["held_agree"]) if log["draft"] else 0):
        ax2.plot([r["step"] for r in log["draft"]], [r["held_agree"][k] for r in log["draft"]], label=f"draft {k + 1}")
    for prev, r in zip(log["draft"], log["draft"][1:]):   # a log joined from runs at different numerics
        if r.get("numerics") != prev.get("numerics"):
            ax2.axvline(prev["step"], color="0.5", ls="--")
            ax2.text(prev["step"], 0.05, f" {r['numerics']} numerics from here", color="0.3")
    ax2.set(xlabel="draft step", ylabel="agreement with the target's greedy token",
            title="DSpark stages (held-out documents' continuations)", ylim=(0, 1))
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="scripts.demo_data output folder")
    ap.add_argument("--work", required=True, help="orbax checkpoints, log.json, weights.npz")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lm-seconds", type=float, default=0.0, help="backbone training budget (0: skip)")
    ap.add_argument("--draft-seconds", type=float, default=0.0, help="draft-stage budget (0: skip)")
    ap.add_argument("--wall-seconds", type=float, default=0.0,
                    help="end within this wall-clock time: shortens the LM budget once its step compiled")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--qat-fraction", type=float, default=0.15)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--draft-batch", type=int, default=64, help="sequences per draft step")
    ap.add_argument("--draft-anchors", type=int, default=32, help="anchors per sequence per draft step")
    ap.add_argument("--draft-sequences", type=int, default=4096,
                    help="greedy continuations of training prefixes to train on (at most)")
    ap.add_argument("--draft-data-seconds", type=float, default=0.0,
                    help="stop generating continuations after this long (0: all --draft-sequences)")
    ap.add_argument("--draft-gen-batch", type=int, default=1024, help="continuations generated per call")
    ap.add_argument("--draft-held", type=int, default=256, help="held-out continuations the drafts are measured on")
    ap.add_argument("--draft-eval-every", type=int, default=500, help="draft steps between held-out measurements")
    ap.add_argument("--draft-numerics", default="fast", choices=("fast", "reference", "fp32"),
                    help="the draft phase's numerics: the target's continuations and taps, the stages' "
                    "loss (default: the engine's default)")
    ap.add_argument("--fresh-drafts", action="store_true",
                    help="with --init-from: train the draft stages from their initialisation, not the checkpoint's")
    ap.add_argument("--eval-every", type=int, default=200, help="held-out perplexity every N steps (a multiple of 25)")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows of 257 tokens for perplexity")
    ap.add_argument("--max-windows", type=int, default=0, help="train on this many windows only (0: all)")
    ap.add_argument("--init-from", help="with --draft-seconds alone: the target (and draft stages to "
                    "continue) from this published checkpoint instead of WORK's orbax backbone")
    ap.add_argument("--export", help="write the published checkpoint's shards here from WORK/weights.npz")
    ap.add_argument("--metadata", help="write config, tokenizer, token map and aliases here")
    ap.add_argument("--plot", help="draw WORK/log.json's curves into this PNG")
    args = ap.parse_args(argv)
    if args.lm_seconds or args.draft_seconds:
        with training_kernels():
            tr = Trainer(args)
            if args.lm_seconds:
                tr.train_lm(args.lm_seconds)
            elif args.init_from:   # the draft phase alone, on a shipped target
                shipped = from_checkpoint(args.init_from)
                mtp = tr.params["model"]["mtp"] if args.fresh_drafts else shipped["model"]["mtp"]
                tr.params = {**shipped, "model": {**shipped["model"], "mtp": mtp}}
            else:   # the draft phase alone continues from a finished backbone
                tr.params = {**tr.params, "model": {**tr.params["model"], **_restored_backbone(tr)}}
            if not args.init_from:   # a shipped target's perplexity was measured when it shipped
                ppl32 = tr.held_ppl(tr.params)
                pplq = tr.held_ppl(tr.quantized(tr.params))
                tr.log["result"].update(heldout_ppl_fp32=ppl32, heldout_ppl_published_weights=pplq,
                                        eval_windows=len(tr.eval_tokens), eval_seq=SEQ)
                print(f"held-out ppl: fp32 {ppl32:.3f}, published weights {pplq:.3f}", flush=True)
            tr._write_log()
            tr.save_params()
            if args.draft_seconds:
                tr.train_draft(args.draft_seconds)
                tr.save_params()
            tr._write_log()
    if args.export:
        export(args.config, os.path.join(args.work, "weights.npz"), args.export)
    if args.metadata:
        write_metadata(args.config, args.data, args.metadata)
    if args.plot:
        plot_log(os.path.join(args.work, "log.json"), args.plot)
    return 0


def from_checkpoint(ckpt: str) -> dict:
    """A published checkpoint (read by the reader) as `init_params`' pytree: the published values
    in fp32, the host Engram tables dequantized into trainable arrays. Exporting it again gives
    back the same values (each lies on its format's grid)."""
    import jax
    import jax.numpy as jnp

    from v41_jax import quant
    from v41_jax.checkpoint.load import ENGRAM_KEY, load_params

    _, params = load_params(ckpt, progress=False, experts="bf16", dense="bf16")   # fp32 masters of every weight
    tables = params.pop(ENGRAM_KEY)
    return {"model": jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), params),
            "engram": {str(l): quant.dequant_fp8_rows(tables.weight[l], tables.scale[l], 32, jnp.float32)
                       for l in tables.weight}}


def _restored_backbone(tr: Trainer) -> dict:
    trained, mtp = tr.split()
    tr.lm_opt = tr._optimizer(tr.args.lr)
    state = tr._restore(tr._manager("ckpt_lm"), {"trained": trained, "opt": tr.lm_opt.init(trained),
                                                 "step": 0, "spent": 0.0})
    if state is None:
        raise SystemExit("--draft-seconds without --lm-seconds needs a finished backbone in WORK/ckpt_lm")
    tr.params = {**tr.params, "engram": state["trained"]["engram"]}
    return state["trained"]["model"]


if __name__ == "__main__":
    raise SystemExit(main())
