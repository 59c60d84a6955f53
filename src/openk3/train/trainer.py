"""The training loop behind ``openk3 train``.

One optimizer step = ``grad_accum`` micro-batches of packed rows (documents never attend across a boundary: the
packed row goes through the model's varlen path with ``cu_seqlens``). After the optimizer step: Quantile Balancing
moves each MoE layer's correction bias (histograms summed over the micro-batches and, when distributed, all-reduced
across ranks), QK-Clip rescales MLA heads whose max logit exceeded tau, and the schedule advances.

Checkpoints (every ``ckpt_every`` steps and at the end) are directories ``OUT/checkpoints/step_NNNNNNN`` written aside
and renamed into place: the model in the released safetensors format plus ``trainer_state.pt`` (optimizer, scheduler,
balancer, data position, RNG states; loaded with ``weights_only=True``). ``--resume`` continues from the newest one so
that the loss trajectory equals an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.config import K3Config, get_preset, mistyped_field

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"


class TrainError(RuntimeError):
    """A training run cannot start or continue; the message says what to change."""


@dataclass
class TrainConfig:
    preset: str = "tiny"
    config: str | None = None  # config.json path (overrides preset)
    data: str = "stdlib"  # "stdlib[:max_bytes]" or a .txt/.jsonl/.parquet file or directory
    text_field: str = "text"
    corpus_bytes: int = 2_000_000  # cap of the embedded corpus for the default run
    tokenizer: str | None = None  # tokenizer.json / tiktoken file / dir; None -> train a byte-level BPE
    steps: int = 150
    seq_len: int = 128
    batch_tokens: int = 1024  # tokens per optimizer step (all ranks, all micro-batches)
    grad_accum: int = 1
    lr: float = 0.02  # Muon learning rate
    adam_lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.01
    schedule: str = "cosine"  # cosine | wsd
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    per_head_muon: bool = True
    router_optimizer: str = "muon"  # muon | adamw: the MoE router weight's optimizer
    balance: str = "qb"  # qb | sign | none
    balance_bins: int = 512
    sign_rate: float = 1e-3
    qk_clip_tau: float | None = 100.0
    out: str = "runs/default"
    resume: bool = False
    ckpt_every: int = 100
    keep_ckpts: int = 2
    eval_every: int = 25
    eval_batches: int = 4
    log_every: int = 1
    sample_tokens: int = 48
    sample_prompt: str = "def "
    sample_temperature: float = 0.8  # 0 = greedy
    device: str = "auto"
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    gradient_checkpointing: bool = False
    seed: int = 0
    tensorboard: bool = False
    progress: bool = True
    nproc: int = 1
    ep: int = 1
    overrides: dict[str, Any] = field(default_factory=dict)  # model config overrides
    backends: dict[str, str] = field(
        default_factory=dict
    )  # per-op backend, e.g. {"kda": "reference"}; default auto

    @classmethod
    def from_file(cls, path: str) -> dict[str, Any]:
        """Keys of a TOML or YAML run file (same names as the command-line options)."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"run config file {path!r} does not exist")
        if path.endswith(".toml"):
            import tomllib

            with open(path, "rb") as f:
                d = tomllib.load(f)
        elif path.endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError:
                raise TrainError("reading YAML run files needs PyYAML: pip install pyyaml") from None
            with open(path, encoding="utf-8") as f:
                d = yaml.safe_load(f) or {}
        else:
            raise TrainError(f"{path}: run config files must be .toml or .yaml")
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(k.replace("-", "_") for k in d if k.replace("-", "_") not in known)
        if bad:
            raise TrainError(
                f"{path}: unknown keys {bad}; valid keys are the train options ({sorted(known)})"
            )
        return {k.replace("-", "_"): v for k, v in d.items()}


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    return dev


def _dtype(spec: str, dev: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    table = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if spec not in table:
        raise TrainError(f"--dtype must be auto, fp32 or bf16, got {spec!r}")
    return table[spec]


def rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state(), "python": repr(random.getstate())}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    import ast

    torch.set_rng_state(st["torch"])
    v = ast.literal_eval(st["python"])
    random.setstate((v[0], tuple(v[1]), v[2]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def _group_signature(param_groups) -> list[list]:
    """[name, parameter count] of each optimizer group: what a resumed run's optimizer must match."""
    return [[g.get("group_name"), len(g["params"])] for g in param_groups]


def list_checkpoints(out: str) -> list[str]:
    d = os.path.join(out, CKPT_DIR)
    if not os.path.isdir(d):
        return []
    names = sorted(n for n in os.listdir(d) if n.startswith("step_") and not n.endswith(".tmp"))
    return [os.path.join(d, n) for n in names]


def moe_layers(model) -> list:
    return [layer.block_sparse_moe for layer in model.model.layers if layer.is_moe]


def mla_layers(model) -> list:
    return [layer.self_attn for layer in model.model.layers if layer.attn_type == "mla"]


# ---------------------------------------------------------------------------------------------------------------


class Trainer:
    def __init__(self, tc: TrainConfig, *, dist=None):
        self.tc = tc
        self.dist = dist  # openk3.train.distributed.DistInfo or None
        self.rank = dist.rank if dist else 0
        self.world = dist.world_size if dist else 1
        self.distributed = dist is not None and self.world > 1
        self.is_main = self.rank == 0
        self.device = dist.device if dist else _device(tc.device)
        self.dtype = _dtype(tc.dtype, self.device)
        self._validate()
        torch.manual_seed(tc.seed)
        random.seed(tc.seed)
        os.makedirs(tc.out, exist_ok=True)
        self.tokenizer = self._tokenizer()
        self.model_config = self._model_config()
        self._data()
        self._build()
        self.step = 0
        self.metrics_path = os.path.join(tc.out, "metrics.jsonl")
        self.tb = None

    # ----------------------------------------------------------------------------------------------- setup
    def _validate(self) -> None:
        tc = self.tc

        def flag(name: str) -> str:
            return "--" + name.replace("_", "-")

        # types first: a run file's "0.02" or "yes" is not a number or a switch
        bad = mistyped_field(tc)
        if bad:
            name, kind, v = bad
            must = {
                "bool": "true or false",
                "int": "an integer",
                "float": "a finite number",
                "str": "a string",
            }
            raise TrainError(f"{flag(name)} must be {must[kind]}, got {v!r}")
        for name in (
            "steps",
            "seq_len",
            "batch_tokens",
            "grad_accum",
            "ckpt_every",
            "eval_every",
            "log_every",
            "keep_ckpts",
            "eval_batches",
            "balance_bins",
            "corpus_bytes",
            "nproc",
            "ep",
        ):
            v = getattr(tc, name)
            if v < 1:
                raise TrainError(f"{flag(name)} must be a positive integer, got {v!r}")
        if tc.sample_tokens < 0:
            raise TrainError(f"--sample-tokens must be >= 0 (0: no sample), got {tc.sample_tokens}")
        for name in ("weight_decay", "grad_clip", "sample_temperature"):  # 0 turns these off
            if getattr(tc, name) < 0:
                raise TrainError(f"{flag(name)} must be >= 0, got {getattr(tc, name)!r}")
        for name in ("warmup_frac", "min_lr_ratio"):
            if not 0 <= getattr(tc, name) <= 1:
                raise TrainError(f"{flag(name)} must lie in [0, 1], got {getattr(tc, name)!r}")
        if tc.sign_rate <= 0:
            raise TrainError(f"--sign-rate must be > 0, got {tc.sign_rate!r}")
        if tc.qk_clip_tau is not None and tc.qk_clip_tau <= 0:
            raise TrainError(
                f"--qk-clip-tau must be > 0 (or 0 on the command line: off), got {tc.qk_clip_tau!r}"
            )
        if tc.batch_tokens % tc.seq_len:
            raise TrainError(f"--batch-tokens {tc.batch_tokens} must be a multiple of --seq-len {tc.seq_len}")
        rows = tc.batch_tokens // tc.seq_len
        if rows < self.world * tc.grad_accum or rows % (self.world * tc.grad_accum):
            raise TrainError(
                f"--batch-tokens {tc.batch_tokens} / --seq-len {tc.seq_len} = {rows} rows must be a positive "
                f"multiple of world size x grad accumulation = {self.world * tc.grad_accum}"
            )
        if tc.lr <= 0 or tc.adam_lr <= 0:
            raise TrainError("--lr and --adam-lr must be > 0")
        if tc.schedule not in ("cosine", "wsd"):
            raise TrainError(f"--schedule must be cosine or wsd, got {tc.schedule!r}")
        if tc.router_optimizer not in ("muon", "adamw"):
            raise TrainError(f"--router-optimizer must be muon or adamw, got {tc.router_optimizer!r}")
        if tc.balance not in ("qb", "sign", "none"):
            raise TrainError(f"--balance must be qb, sign or none, got {tc.balance!r}")
        from openk3.ops import backend as _backend

        try:
            self.backends = _backend.parse_choices(tc.backends, self.device.type == "cuda")
        except ValueError as e:
            raise TrainError(f"--backend: {e}") from None

    def _tokenizer(self):
        from openk3.train.tokenizer import Tokenizer

        tc = self.tc
        if tc.tokenizer:
            return Tokenizer.from_file(tc.tokenizer)

        vocab = (K3Config.from_pretrained(tc.config) if tc.config else get_preset(tc.preset)).vocab_size
        vocab = int(tc.overrides.get("vocab_size", vocab))
        if vocab > 65536:
            raise TrainError(
                f"the model's vocab_size is {vocab}: training a BPE that large on the embedded corpus is not "
                "meaningful; pass --tokenizer PATH or override vocab_size (e.g. --set vocab_size=32768)"
            )
        docs = self._documents()
        cache = os.path.join(
            os.path.expanduser(os.environ.get("OPENK3_CACHE", "~/.cache/openk3")), "tokenizers"
        )
        return Tokenizer.train_bpe(docs, vocab_size=vocab, cache_dir=cache)

    def _documents(self) -> list[str]:
        """The data set's documents, read once (the tokenizer and the batcher both use them)."""
        if not hasattr(self, "_docs"):
            from openk3.train.data import load_documents

            spec = self.tc.data
            if spec == "stdlib":
                spec = f"stdlib:{self.tc.corpus_bytes}"
            self._docs = list(load_documents(spec, text_field=self.tc.text_field))
        return self._docs

    def _model_config(self) -> K3Config:
        tc = self.tc
        cfg = K3Config.from_pretrained(tc.config) if tc.config else get_preset(tc.preset)
        over = dict(tc.overrides)
        over["vocab_size"] = self.tokenizer.vocab_size
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            over[k] = getattr(self.tokenizer, k.replace("_token_id", "_id"), None)
        if over.get("vocab_size", cfg.vocab_size) < cfg.vocab_size and tc.tokenizer:
            over["vocab_size"] = (
                cfg.vocab_size
            )  # keep a real checkpoint's vocab when the tokenizer is smaller
        return cfg.replace(**over)

    def _data(self) -> None:
        from openk3.train.data import Batcher, train_val_split

        tc = self.tc
        docs = self._documents()
        if not docs:
            raise TrainError(f"the data set {tc.data!r} is empty")
        every = 50 if len(docs) >= 100 else max(2, len(docs) // 5)
        train, val = train_val_split(docs, every=every) if len(docs) >= 4 else (docs, docs[:1])
        tok = self.tokenizer
        enc_train = [d for d in tok.encode_batch(train, allow_special=False) if d]
        enc_val = [d for d in tok.encode_batch(val, allow_special=False) if d]
        if not enc_train:
            raise TrainError(f"the data set {tc.data!r} has no tokens after tokenization")
        rows = tc.batch_tokens // tc.seq_len
        self.rows_per_micro = rows // tc.grad_accum  # global rows of one micro-batch (all ranks)
        eos = tok.eos_id if tok.eos_id is not None else 0
        self.batcher = Batcher(enc_train, tc.seq_len, self.rows_per_micro, eos_id=eos, seed=tc.seed)
        vb = Batcher(
            enc_val or enc_train,
            tc.seq_len,
            max(1, self.rows_per_micro),
            eos_id=eos,
            seed=tc.seed + 1,
            shuffle=False,
        )
        self.val_batches = [next(vb) for _ in range(tc.eval_batches)]
        self.train_tokens = sum(len(d) + 1 for d in enc_train)

    def _build(self) -> None:
        from openk3.model import K3ForCausalLM
        from openk3.train.balance import QuantileBalancer
        from openk3.train.optim import build_optimizer, warmup_cosine, wsd

        tc, cfg = self.tc, self.model_config
        model = K3ForCausalLM(cfg)  # same seed on every rank -> identical initial weights
        for op, name in self.backends.items():
            model.set_backend(op, name)
        self.mesh = None
        if self.distributed:
            from openk3.train import distributed as D

            if self.world % tc.ep:
                raise TrainError(f"--ep {tc.ep} must divide the number of processes {self.world}")
            if cfg.num_experts % tc.ep:
                raise TrainError(f"--ep {tc.ep} must divide num_experts {cfg.num_experts}")
            model.to(self.device)
            self.mesh = D.build_mesh(self.world, ep=tc.ep)
            D.apply_expert_parallel(model, self.mesh)
            # fp32 master weights; FSDP2 casts to the compute dtype and reduces in fp32
            D.apply_fsdp(model, self.mesh, param_dtype=self.dtype, reduce_dtype=torch.float32)
        else:
            if self.dtype != torch.float32:
                model.to_dtype(self.dtype)
            model.to(self.device)
        model.model.gradient_checkpointing = tc.gradient_checkpointing
        self.model = model
        self.fwd = torch.compile(model) if tc.compile else model
        self.optimizer = build_optimizer(
            model,
            lr=tc.lr,
            muon_lr=tc.lr,
            adam_lr=tc.adam_lr,
            weight_decay=tc.weight_decay,
            per_head=tc.per_head_muon,
            config=cfg,
            router=tc.router_optimizer,
        )
        sched = warmup_cosine if tc.schedule == "cosine" else wsd
        kw = {"min_lr_ratio": tc.min_lr_ratio} if tc.schedule == "cosine" else {}
        self.scheduler = sched(self.optimizer, tc.steps, warmup_frac=tc.warmup_frac, **kw)
        self.moes = moe_layers(model)
        self.mlas = mla_layers(model)
        for m in self.moes:
            m.record_router = True  # load statistics are always logged
        for m in self.mlas:
            m.record_max_logit = tc.qk_clip_tau is not None
        self.balancer = (
            QuantileBalancer(
                cfg.num_experts,
                cfg.num_experts_per_token,
                num_layers=len(self.moes),
                num_bins=tc.balance_bins,
                device=self.device,
            )
            if self.moes and tc.balance == "qb"
            else None
        )
        self.load_counts = torch.zeros(
            max(1, len(self.moes)), cfg.num_experts, dtype=torch.long, device=self.device
        )
        with torch.device("meta"):
            meta = K3ForCausalLM(cfg)
        self.n_params, self.n_active = meta.num_parameters(), meta.num_active_parameters()
        self.flops_per_token = self._flops_per_token()

    def _flops_per_token(self) -> float:
        try:
            from openk3 import cost

            return float(cost.train_flops_per_token(self.model_config, self.tc.seq_len))
        except Exception:
            return 6.0 * self.n_active

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "balancer": self.balancer.state_dict() if self.balancer is not None else None,
            "data": self.batcher.state_dict(),
            "rng": rng_state(),
            "train_config": json.dumps(dataclasses.asdict(self.tc), sort_keys=True),
        }

    def save_checkpoint(self) -> str:
        """Write ``checkpoints/step_N`` atomically (aside, then rename) and prune old ones."""
        tc = self.tc
        final = os.path.join(tc.out, CKPT_DIR, f"step_{self.step:07d}")
        if self.distributed:
            from openk3.train import distributed as D

            D.save_dcp(final, self.model, self.optimizer, self._extra_state())
            if self.is_main:  # config + tokenizer beside the DCP shards, for resume checks and export
                self.model_config.save_pretrained(final)
                self.tokenizer.save(final)
            torch.distributed.barrier()
            for old in list_checkpoints(tc.out)[: -tc.keep_ckpts] if self.is_main else []:
                shutil.rmtree(old, ignore_errors=True)
            return final
        tmp = final + ".tmp"
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        self.model.save_pretrained(tmp)
        self.tokenizer.save(tmp)
        torch.save(self.state_dict(), os.path.join(tmp, STATE_FILE))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(tc.out)[: -tc.keep_ckpts]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _extra_state(self) -> dict[str, Any]:
        st = self.state_dict()
        st.pop("optimizer")
        # (DCP keys the optimizer state by parameter: the grouping is kept here, so that a resume can check it)
        st["optimizer_groups"] = _group_signature(self.optimizer.param_groups)
        return st

    def _check_groups(self, path: str, groups: list | None) -> None:
        """TrainError unless ``groups`` (a checkpoint's :func:`_group_signature`; None: not recorded) are this
        run's: a parameter on another optimizer would resume with fresh state or another state's buffers."""
        own = _group_signature(self.optimizer.param_groups)
        if groups is not None and [list(g) for g in groups] != own:
            raise TrainError(
                f"checkpoint {path} was written with other optimizer groups ({groups} against {own}); "
                "resume with the same --per-head-muon / --router-optimizer, or use a new --out"
            )

    def load_checkpoint(self, path: str) -> None:
        """Restore everything from ``path``; raises TrainError (changing nothing on disk) if unusable."""
        from openk3.checkpoint import CheckpointError, checkpoint_files, iter_tensors, to_internal

        if self.distributed:
            from openk3.train import distributed as D

            try:
                saved = K3Config.from_pretrained(os.path.join(path, "config.json"))
            except (FileNotFoundError, ValueError) as e:
                raise TrainError(f"checkpoint {path} is unusable: {e}") from None
            if saved.to_dict() != self.model_config.to_dict():
                raise TrainError(
                    f"checkpoint {path} was written for a different model config; use the same options"
                )
            try:  # (every rank reads rank 0's small extra state: all of them refuse, before any collective load)
                extra = D.read_extra(path)
            except (OSError, RuntimeError, EOFError) as e:
                raise TrainError(f"checkpoint {path} is corrupted or incomplete ({e})") from None
            if not extra:
                raise TrainError(f"checkpoint {path} is corrupted or incomplete (no extra.rank0.pt)")
            self._check_groups(path, extra.get("optimizer_groups"))
            st = D.load_dcp(path, self.model, self.optimizer)
            self._restore(st, with_optimizer=False)
            return
        cfg_path = os.path.join(path, "config.json")
        try:
            saved = K3Config.from_pretrained(cfg_path)
        except (FileNotFoundError, ValueError) as e:
            raise TrainError(f"checkpoint {path} is unusable: {e}") from None
        if saved.to_dict() != self.model_config.to_dict():
            diff = sorted(k for k, v in saved.to_dict().items() if self.model_config.to_dict().get(k) != v)
            raise TrainError(
                f"checkpoint {path} was written for a different model config (differs in {diff}); "
                "resume with the same --preset/--config and tokenizer, or use a new --out"
            )
        try:
            sd = to_internal(saved, iter_tensors(checkpoint_files(path)))
            st = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True)
        except (CheckpointError, OSError, RuntimeError, EOFError) as e:
            raise TrainError(
                f"checkpoint {path} is corrupted or incomplete ({e}); delete it to resume from an earlier one"
            ) from None
        own = self.model.state_dict()
        missing = sorted(set(own) - set(sd))
        if missing:
            raise TrainError(f"checkpoint {path} lacks tensors {missing[:5]}")
        with torch.no_grad():
            for k, v in own.items():
                if tuple(v.shape) != tuple(sd[k].shape):
                    raise TrainError(
                        f"checkpoint {path}: {k} has shape {tuple(sd[k].shape)}, model {tuple(v.shape)}"
                    )
            for k, v in own.items():
                v.copy_(sd[k].to(v.dtype))
        self._check_groups(path, _group_signature(st["optimizer"]["param_groups"]))
        self.optimizer.load_state_dict(st["optimizer"])
        self._restore(st, with_optimizer=True)

    def _restore(self, st: dict[str, Any], *, with_optimizer: bool) -> None:
        self.scheduler.load_state_dict(st["scheduler"])
        if self.balancer is not None and st.get("balancer") is not None:
            self.balancer.load_state_dict(st["balancer"])
        self.batcher.load_state_dict(st["data"])
        set_rng_state(st["rng"])
        self.step = int(st["step"])

    # ----------------------------------------------------------------------------------------------- steps
    def _micro_slice(self, batch):
        """This rank's rows of a global micro-batch, packed into one row with cu_seqlens."""
        rows = batch.input_ids.shape[0]
        per = rows // self.world
        sl = slice(self.rank * per, (self.rank + 1) * per)
        ids = batch.input_ids[sl]
        labels = batch.labels[sl]
        L = ids.shape[1]
        # segment boundaries of the selected rows, re-based
        cu = batch.cu_seqlens.long()
        lo, hi = sl.start * L, sl.stop * L
        inner = cu[(cu > lo) & (cu < hi)] - lo
        cu_local = torch.cat([torch.tensor([0]), inner, torch.tensor([hi - lo])])
        return ids.reshape(1, -1), labels.reshape(1, -1), cu_local

    def train_step(self) -> dict[str, float]:
        tc = self.tc
        self.model.train()
        micro = [next(self.batcher) for _ in range(tc.grad_accum)]
        parts = [self._micro_slice(b) for b in micro]
        n_tgt = torch.tensor(float(sum(int((lab != -100).sum()) for _, lab, _ in parts)), device=self.device)
        if self.distributed:
            torch.distributed.all_reduce(n_tgt)
        total_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        self.load_counts.zero_()
        max_logits = None
        for ids, labels, cu in parts:
            ids, labels, cu = ids.to(self.device), labels.to(self.device), cu.to(self.device)
            out = self.fwd(ids, cu_seqlens=cu, return_logits=True)
            logits = out.logits.float()
            loss_sum = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )
            # mean over all targets of the step on all ranks (FSDP averages gradients over ranks)
            (loss_sum * self.world / n_tgt).backward()
            total_loss += loss_sum.detach().double()
            self._observe_router()
            if tc.qk_clip_tau is not None and self.mlas:
                ml = torch.stack([m.max_logit for m in self.mlas])
                max_logits = ml if max_logits is None else torch.maximum(max_logits, ml)
        if self.distributed:
            from openk3.train import distributed as D

            torch.distributed.all_reduce(total_loss)
            if max_logits is not None:
                torch.distributed.all_reduce(max_logits, op=torch.distributed.ReduceOp.MAX)
            D.allreduce_grads(
                self.model, self.mesh
            )  # replicated params and EP experts (FSDP reduced its own)
            gnorm = D.clip_grad_norm_(self.model, tc.grad_clip, self.mesh) if tc.grad_clip else None
        elif tc.grad_clip:
            gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        else:
            gnorm = None
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        ratios = self._rebalance()
        clipped = self._qk_clip(max_logits)
        self.step += 1
        m = {
            "step": self.step,
            "loss": float(total_loss / n_tgt.double()),
            "lr": lr,
            "grad_norm": float(gnorm) if gnorm is not None else None,
            **ratios,
            **clipped,
        }
        return m

    def _observe_router(self) -> None:
        for li, moe in enumerate(self.moes):
            if moe.last_router is None:
                continue
            scores, idx = moe.last_router
            self.load_counts[li] += torch.bincount(idx.reshape(-1), minlength=self.load_counts.shape[1])
            if self.balancer is not None:
                self.balancer.observe(scores, moe.gate.e_score_correction_bias, layer=li)
            moe.last_router = None

    @torch.no_grad()
    def _rebalance(self) -> dict[str, float]:
        if not self.moes:
            return {}
        counts = self.load_counts.clone()
        if self.distributed:
            torch.distributed.all_reduce(counts)
        mean = counts.float().mean(-1).clamp_min(1e-9)
        per_max = (counts.float().amax(-1) / mean).tolist()  # per MoE layer
        per_min = (counts.float().amin(-1) / mean).tolist()
        max_r, min_r = max(per_max), min(per_min)
        if self.balancer is not None:
            if self.distributed:
                from openk3.train import distributed as D

                D.allreduce_balancer(self.balancer)
            bias = self.balancer.compute_bias()
            for li, moe in enumerate(self.moes):
                moe.gate.e_score_correction_bias.copy_(bias[li])
            self.balancer.reset()
        elif self.tc.balance == "sign":
            from openk3.train.balance import sign_update_bias

            for li, moe in enumerate(self.moes):
                b = moe.gate.e_score_correction_bias
                b.copy_(sign_update_bias(b, counts[li].float(), rate=self.tc.sign_rate))
        return {
            "load_max_ratio": round(max_r, 4),  # rounded like the per-layer lists, so max(per layer) == this
            "load_min_ratio": round(min_r, 4),
            "load_max_ratio_per_layer": [round(x, 4) for x in per_max],
            "load_min_ratio_per_layer": [round(x, 4) for x in per_min],
        }

    @torch.no_grad()
    def _qk_clip(self, max_logits) -> dict[str, float]:
        if max_logits is None:
            return {}
        from openk3.train.optim import qk_clip_

        c = self.model_config
        n_clipped = 0
        for attn, ml in zip(self.mlas, max_logits):
            qw = attn.q_proj.weight if attn.q_lora_rank is None else attn.q_b_proj.weight
            gamma = qk_clip_(
                qw,
                attn.kv_b_proj.weight,
                ml,
                tau=self.tc.qk_clip_tau,
                num_heads=c.num_attention_heads,
                qk_nope_head_dim=c.qk_nope_head_dim,
                qk_rope_head_dim=c.qk_rope_head_dim,
                v_head_dim=c.v_head_dim,
            )
            n_clipped += int((gamma < 1).sum())
        return {"max_logit": float(max_logits.max()), "qk_clipped_heads": n_clipped}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        for m in self.mlas:
            m.record_max_logit = False
        tot, n = 0.0, 0
        for b in self.val_batches:
            ids, labels, cu = self._micro_slice(b)
            out = self.fwd(ids.to(self.device), cu_seqlens=cu.to(self.device))
            logits = out.logits.float()
            tot += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    labels.to(self.device).reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
            )
            n += int((labels != -100).sum())
        for m in self.mlas:
            m.record_max_logit = self.tc.qk_clip_tau is not None
        for moe in self.moes:
            moe.last_router = None
        self.model.train()
        if self.distributed:
            t = torch.tensor([tot, float(n)], device=self.device, dtype=torch.float64)
            torch.distributed.all_reduce(t)
            tot, n = float(t[0]), int(t[1])
        return tot / max(n, 1)

    @torch.no_grad()
    def sample(self, prompt: str | None = None, n: int | None = None) -> str:
        self.model.eval()
        for m in self.mlas:
            m.record_max_logit = False
        for moe in self.moes:
            moe.record_router = False
        ids = self.tokenizer.encode(
            prompt if prompt is not None else self.tc.sample_prompt, allow_special=False
        )
        x = torch.tensor([ids or [0]], device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(self.tc.seed)
        out = self.model.generate(
            x,
            max_new_tokens=n if n is not None else self.tc.sample_tokens,
            temperature=self.tc.sample_temperature,
            top_k=50,
            generator=gen,
        )
        for moe in self.moes:
            moe.record_router = True
        for m in self.mlas:
            m.record_max_logit = self.tc.qk_clip_tau is not None
        return self.tokenizer.decode(out[0].tolist())

    # ----------------------------------------------------------------------------------------------- loop
    def _log(self, rec: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])

    def run(self) -> dict[str, Any]:
        tc = self.tc
        if tc.resume:
            ck = list_checkpoints(tc.out)
            if not ck:
                raise TrainError(f"--resume: no checkpoint under {os.path.join(tc.out, CKPT_DIR)}")
            self.load_checkpoint(ck[-1])
            if self.is_main:
                print(f"resumed from {ck[-1]} at step {self.step}")
        elif self.is_main and os.path.exists(self.metrics_path):
            os.remove(self.metrics_path)
        if self.is_main:
            with open(os.path.join(tc.out, "run.json"), "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "train": dataclasses.asdict(tc),
                        "model": self.model_config.to_dict(),
                        "params": self.n_params,
                        "active_params": self.n_active,
                    },
                    f,
                    indent=2,
                )
            if tc.tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.tb = SummaryWriter(os.path.join(tc.out, "tb"))
                except ImportError:
                    print("tensorboard is not installed; pip install tensorboard (continuing without it)")
            print(
                f"model: {self.model_config.name or 'custom'} {self.n_params:,} params ({self.n_active:,} active); "
                f"data: {self.train_tokens:,} tokens; {tc.steps} steps x {tc.batch_tokens} tokens on "
                f"{self.device} ({str(self.dtype).replace('torch.', '')}, world {self.world})"
            )
        peak = _peak_flops(self.device)
        bar = None
        if tc.progress and self.is_main:
            from tqdm import tqdm

            bar = tqdm(total=tc.steps, initial=self.step, dynamic_ncols=True, desc="train")
        first = self.step
        t_last = time.perf_counter()
        last = {}
        while self.step < tc.steps:
            rec = self.train_step()
            now = time.perf_counter()
            dt, t_last = now - t_last, now
            tps = tc.batch_tokens / dt
            rec["tokens_per_s"] = tps
            if peak:
                rec["mfu"] = tps * self.flops_per_token / (peak * self.world)
            if self.step % tc.eval_every == 0 or self.step == tc.steps:
                rec["val_loss"] = self.evaluate()
            if self.step % tc.log_every == 0 or "val_loss" in rec:
                self._log(rec)
            last = rec
            if bar is not None:
                post = {"loss": f"{rec['loss']:.3f}", "tok/s": f"{tps:,.0f}", "lr": f"{rec['lr']:.2e}"}
                if "load_max_ratio" in rec:
                    post["load"] = f"{rec['load_max_ratio']:.2f}"
                if "mfu" in rec:
                    post["mfu"] = f"{100 * rec['mfu']:.1f}%"
                bar.set_postfix(post)
                bar.update(1)
            if self.step % tc.ckpt_every == 0 or self.step == tc.steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        result = {"steps": self.step - first, **last}
        if self.is_main:
            final = os.path.join(tc.out, "final")
            if not self.distributed:
                tmp = final + ".tmp"
                if os.path.exists(tmp):
                    shutil.rmtree(tmp)
                self.model.save_pretrained(tmp)
                self.tokenizer.save(tmp)
                if os.path.exists(final):
                    shutil.rmtree(final)
                os.replace(tmp, final)
                result["final"] = final
            if tc.sample_tokens > 0 and not self.distributed:  # sharded weights: sample after `openk3 export`
                text = self.sample()
                result["sample"] = text
                print("\nsample:\n" + text)
        if self.tb is not None:
            self.tb.close()
        return result


def _peak_flops(dev: torch.device) -> float | None:
    """Dense bf16 matmul rate used for MFU: the H200 rate measured in this project, else the datasheet value."""
    if dev.type != "cuda":
        return None
    env = os.environ.get("OPENK3_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    name = torch.cuda.get_device_name(dev)
    if "H200" in name or "H100" in name:
        return 790e12 if "H200" in name else 989e12
    if "B200" in name:
        return 2250e12
    if "A100" in name:
        return 312e12
    return None


def export_run(run_dir: str, out_dir: str) -> str:
    """Write a released-format checkpoint (config.json + safetensors + tokenizer) from a run directory's final
    weights or newest checkpoint."""
    from openk3.model import K3ForCausalLM

    src = os.path.join(run_dir, "final")
    if not os.path.exists(os.path.join(src, "config.json")):
        ck = list_checkpoints(run_dir)
        if not ck:
            raise TrainError(f"{run_dir} has neither final/ nor checkpoints/step_*; nothing to export")
        src = ck[-1]
    if not os.path.exists(os.path.join(src, "model.safetensors")) and not os.path.exists(
        os.path.join(src, "model.safetensors.index.json")
    ):
        model = dcp_to_model(src)
    else:
        model = K3ForCausalLM.from_pretrained(src)
    model.save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "tiktoken.model"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(out_dir, f))
    return out_dir


def dcp_to_model(path: str):
    """Load a distributed (DCP) training checkpoint into one in-process model (world size 1)."""
    import torch.distributed as td

    from openk3.model import K3ForCausalLM
    from openk3.train import distributed as D

    cfg = K3Config.from_pretrained(os.path.join(path, "config.json"))
    model = K3ForCausalLM(cfg)
    own = not td.is_initialized()
    if own:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        td.init_process_group("gloo", rank=0, world_size=1)
    try:
        D.load_dcp(path, model)
    finally:
        if own:
            td.destroy_process_group()
    return model


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
