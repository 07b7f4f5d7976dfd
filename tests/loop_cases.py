"""Training-loop idioms against one device, run inside the shared parity launches (``tests/parity.py``).

A case is ("loop", mesh, "<idiom>/<plan kind>", sabotage). Plan kinds (``plan_options``): "dp" (the batch
split, parameters replicated: every gradient goes through the bucketed sync), "z1"/"z2"/"z3" (the same with
that ZeRO level), "tp" (Megatron's MLP split on the last mesh axis, the batch on the first), "pp" (HF GPT-2
in 2 stages of one device, 2 microbatches, 1F1B: its tied embedding goes through the cross-stage sync),
"ppv2" (interleaved 1F1B: the 4-layer GPT example in 2 stages of 2 devices × 2 chunks), "fp16" (dp under
fp16 with dynamic loss scaling). Idioms (``IDIOMS``), each 2 optimizer steps, compared with the same loop on a
single-device copy: parameters (relative error per tensor with a nonzero gradient) and losses.

Sabotages (negative controls): "old_sync" puts back the gradient sync that reduced what a rank already
held again (accumulation counted it twice, or lost it at ZeRO-2/3).
"""
import contextlib
import copy
import types

import torch

import autopar
from autopar.runtime import clipping, gradsync
from tests.models import FACTORIES
from tests.parity import rel

LR, EPS, SGD_LR = 1e-3, 1e-6, 0.1
MLP_TP = {"p_fc1_weight": "S(0)", "p_fc1_bias": "S(0)", "p_fc2_weight": "S(1)"}


def plan_options(kind: str, mesh: tuple) -> tuple[str, dict]:
    """(model name, compile options) of a plan kind on ``mesh``."""
    def spec(last: str, first: str = "S(0)") -> str:  # first axes ``first``, the last axis ``last`` (size 1: R)
        return "".join("R" if size == 1 else (last if a == len(mesh) - 1 else first) for a, size in enumerate(mesh))

    batch = {"x": spec("S(0)"), "y": spec("S(0)")}
    if kind in ("dp", "z1", "z2", "z3", "fp16"):
        zero = {"zero": int(kind[1])} if kind[0] == "z" else {"zero": 0}
        precision = {"precision": "fp16"} if kind == "fp16" else {}
        return "mlp", {"stages": 1, "pin": {"p_*": "R" * len(mesh), **batch}, **zero, **precision}
    if kind == "tp":
        pins = {name: spec(s, "R") for name, s in MLP_TP.items()}
        return "mlp", {"stages": 1, "zero": 0, "pin": {"p_*": "R" * len(mesh), **pins, "x": spec("R"), "y": spec("R")}}
    if kind == "pp":
        stages = [{"layers": [k, k], "submesh": [1, 1]} for k in range(2)]
        return "hf_gpt2", {"stages": stages, "microbatches": 2, "layers": 2, "schedule": "1f1b", "zero": 0}
    if kind == "ppv2":
        stages = [{"layers": [k, k], "submesh": [1, 2]} for k in range(4)]  # 2 devices x 2 chunks on 4 ranks
        return "gpt4", {"stages": stages, "microbatches": 2, "layers": 4, "schedule": "interleaved",
                        "virtual_stages": 2, "zero": 0}
    raise ValueError(kind)


class BatchNormMLP(torch.nn.Module):
    """The MLP's shapes with a BatchNorm and a dropout: what ``pm.train()``/``pm.eval()`` must switch."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 16)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.fc2(self.drop(torch.relu(self.bn(self.fc1(x))))), y)


class DropoutMLP(torch.nn.Module):
    """The MLP with a dropout on its hidden values (sharded under "tp") and one on fc2's output (replicated)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 128), torch.nn.Linear(128, 16)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, y):
        h = self.drop(torch.relu(self.fc2(self.drop(torch.relu(self.fc1(x))))))
        return torch.nn.functional.mse_loss(self.fc3(h), y)


def _with_modes(model_name: str):
    """(model, batch) with dropout (and, for the MLP, BatchNorm): the eval idiom's model for a plan kind."""
    from tests.models import make_mlp, make_small_gpt

    if model_name == "mlp":
        _, batch = make_mlp()
        torch.manual_seed(0)
        model = BatchNormMLP()
        with torch.no_grad():  # running statistics that differ from the batch's
            model.bn.running_mean.uniform_(-1, 1)
            model.bn.running_var.uniform_(0.5, 2)
        return model, batch
    return make_small_gpt(n_layer=4 if model_name == "gpt4" else 2, dropout=0.1)


def _other(batch: tuple) -> tuple:
    g = torch.Generator().manual_seed(1)
    out = []
    for t in batch:
        if t.dtype.is_floating_point:
            out.append(torch.randn(t.shape, generator=g, dtype=t.dtype))
        else:
            out.append(torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype))
    return tuple(out)


class Reference:
    """The single-device copy: AdamW(LR, EPS); fp16 plans are compared under the same autocast + GradScaler."""

    def __init__(self, model, precision: str = "fp32"):
        self.model = copy.deepcopy(model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, eps=EPS)
        self.fp16 = precision == "fp16"
        self.scaler = torch.amp.GradScaler("cpu") if self.fp16 else None
        self.moved: set[str] = set()
        self.norms: list[tuple[float, float]] = []  # (autopar's clipping norm, the true one) per step
        self.refused = None  # torch's norm of autopar's gradients was refused, naming pm.clip_grad_norm_

    def backward(self, batch) -> float:
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.fp16):
            loss = self.model(*batch)
        (self.scaler.scale(loss) if self.fp16 else loss).backward()
        return loss.item()

    def step(self) -> None:
        norms = {k: float(p.grad.norm()) for k, p in self.model.named_parameters() if p.grad is not None}
        top = max(norms.values(), default=0.0)
        self.moved |= {k for k, n in norms.items() if n > 1e-6 * top}
        if self.fp16:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()


def idiom_accumulate(pm, ref: Reference, batches: list) -> float:
    """``train_step(A); train_step(B); opt.step()``, twice."""
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    err = 0.0
    for _ in range(2):
        for batch in batches:
            loss = pm.train_step(*batch).item()
            err = max(err, abs(loss - ref.backward(batch)) / abs(loss))
        opt.step()
        opt.zero_grad()
        ref.step()
    return err


def _steps(pm, opt, ref: Reference, batches: list, after_backward=None) -> float:
    """One optimizer step per batch on both; ``after_backward(ref)`` runs between backward and step."""
    err = 0.0
    for batch in batches:
        loss = pm.train_step(*batch).item()
        err = max(err, abs(loss - ref.backward(batch)) / abs(loss))
        if after_backward is not None:
            after_backward(ref)
        opt.step()
        opt.zero_grad()
        ref.step()
    return err


def idiom_plain_optimizer(pm, ref: Reference, batches: list) -> float:
    """``torch.optim.AdamW(pm.parameters())``, three steps (ZeRO shards and fp16 scaling under the hood)."""
    return _steps(pm, torch.optim.AdamW(pm.parameters(), lr=LR, eps=EPS), ref, batches + batches[:1])


def idiom_clip(pm, ref: Reference, batches: list) -> float:
    """Clip to half the true norm each step: the plain torch call on step 1, ``pm.clip_grad_norm_`` on step 2
    (the returned norms are recorded in ``ref.norms``: (autopar's, the reference's)); torch's norm of this
    rank's gradients (a stale reference to the unpatched function) must be refused."""
    opt = pm.optimizer(torch.optim.SGD, lr=SGD_LR)  # SGD: AdamW's update hardly depends on the gradient's scale
    ref.opt = torch.optim.SGD(ref.model.parameters(), lr=SGD_LR)
    err = 0.0
    for step, batch in enumerate(batches):
        loss = pm.train_step(*batch).item()
        err = max(err, abs(loss - ref.backward(batch)) / abs(loss))
        if ref.fp16:
            ref.scaler.unscale_(ref.opt)
        grads = [p.grad for p in ref.model.parameters() if p.grad is not None]
        true = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        if step == 0:
            mine = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.5 * true)
        else:
            mine = pm.clip_grad_norm_(0.5 * true)
        torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.5 * true)
        ref.norms.append((float(mine), true))
        opt.step()
        opt.zero_grad()
        ref.step()
    pm.train_step(*batches[0])
    try:  # torch's function as imported before autopar patched it
        clipping._ORIGINAL["clip"](pm.parameters(), 1e-3)
        ref.refused = False
    except autopar.errors.UsageError as e:
        ref.refused = "pm.clip_grad_norm_" in str(e)
    opt.zero_grad()
    return err


def idiom_eval(pm, ref: Reference, batches: list) -> float:
    """``pm.eval()``: forward equals the model's ``eval()`` forward (dropout off, BatchNorm on its running
    statistics, which stay as they were); ``pm.train()`` turns dropout back on (two forwards differ) and a
    second ``pm.eval()`` agrees again. ``ref.moved`` becomes the buffers, compared after the eval forwards."""
    err = 0.0
    for _ in range(2):
        pm.eval()
        ref.model.eval()
        with torch.no_grad():
            mine, true = pm(*batches[0]).item(), ref.model(*batches[0]).item()
        err = max(err, abs(mine - true) / abs(true))
        pm.train()
        ref.model.train()
        with torch.no_grad():  # BatchNorm's running statistics move alike (dropout comes after it)
            ref.dropout_on = pm(*batches[1]).item() != pm(*batches[1]).item()
            ref.model(*batches[1]), ref.model(*batches[1])
    ref.modes = (pm.training, all(m.training for m in pm.modules()))
    pm.eval()
    ref.model.eval()
    ref.moved = set(ref.model.state_dict())  # buffers (and the untouched parameters)
    return err


def _decay_groups(named: dict) -> list[dict]:
    """No weight decay on biases and norms (by name), 0.1 elsewhere: the usual split."""
    def plain(name):
        return name.endswith("bias") or "ln" in name
    return [{"params": [n for n in named if plain(n)], "weight_decay": 0.0},
            {"params": [n for n in named if not plain(n)], "weight_decay": 0.1}]


def idiom_groups(pm, ref: Reference, batches: list) -> float:
    """``pm.optimizer(AdamW, param_groups=[{"params": ["*bias", ...], "weight_decay": 0}], ...)`` by the
    model's names (globs), stepped by a ``LambdaLR`` schedule; the reference builds the same groups from
    ``named_parameters`` and the same schedule. Three steps."""
    named = {n: p for n, p in ref.model.named_parameters() if p.requires_grad}
    globs = ["*bias"] + (["*ln*"] if any("ln" in n for n in named) else [])  # a glob matching nothing is an error
    groups = [{"params": globs, "weight_decay": 0.0}]
    try:
        opt = pm.optimizer(torch.optim.AdamW, param_groups=groups, lr=LR, eps=EPS, weight_decay=0.1)
    except autopar.errors.UsageError as e:  # ZeRO: groups that split one shard
        ref.refused = str(e)
        return _steps(pm, pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS), ref, [])
    ref.opt = torch.optim.AdamW([{"params": [named[n] for n in g["params"]], "weight_decay": g["weight_decay"]}
                                 for g in _decay_groups(named)], lr=LR, eps=EPS)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    ref_schedule = torch.optim.lr_scheduler.LambdaLR(ref.opt, lambda step: 1.0 / (1 + step))
    err = 0.0
    for batch in batches + batches[:1]:
        loss = pm.train_step(*batch).item()
        err = max(err, abs(loss - ref.backward(batch)) / abs(loss))
        opt.step()
        opt.zero_grad()
        ref.step()
        schedule.step()
        ref_schedule.step()
    ref.lrs = [g["lr"] for g in opt.param_groups]
    return err


def idiom_rng(pm, ref: Reference, batches: list) -> float:
    """Every rank seeds its own way (``torch.manual_seed(100 + rank)``) before each step; the losses (each
    rank's own, ``ref.losses``) and the replicated weights must agree. Then a checkpoint after step 2:
    step 3 from the loaded module repeats step 3's loss exactly (the dropout stream came back)."""
    import shutil
    import tempfile

    rank = torch.distributed.get_rank()
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    ref.losses = []
    box = [tempfile.mkdtemp(prefix="autopar-rng-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    for step in range(3):
        if step == 2:
            pm.save(box[0], opt)
        torch.manual_seed(100 + rank + step)
        loss = pm.train_step(*batches[0]).item()
        opt.step()
        opt.zero_grad()
        replicated = [t.double().sum() for n, t in pm.state_dict().items() if "fc3" in n]  # ZeRO-3: gathered
        ref.losses.append((loss, float(sum(replicated))))
    pm.load(box[0], opt)
    torch.manual_seed(7 * rank)
    ref.repeat = pm.train_step(*batches[0]).item()
    opt.zero_grad()
    ref.own_draws = pm.code.count("dropout_own_draw")
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    ref.moved = set()
    return 0.0


IDIOMS = {"rng": idiom_rng, "accum": idiom_accumulate, "plainopt": idiom_plain_optimizer, "clip": idiom_clip,
          "eval": idiom_eval,
          "groups": idiom_groups}
FROZEN = ("fc1.*", "*h.0.*", "blocks.0.*", "*wpe*")  # frozen by the "frozen" flag, in every model


def run_loop_case(mesh: tuple, layout: str, world: int) -> dict:
    """``layout``: "<idiom>/<plan kind>", or "<idiom>/<plan kind>/frozen" with the FROZEN parameters frozen
    (``requires_grad_(False)``) before compiling."""
    import fnmatch

    idiom, kind, *flags = layout.split("/")
    model_name, options = plan_options(kind, mesh)
    model, batch = _with_modes(model_name) if idiom == "eval" else FACTORIES[model_name]()
    if idiom == "rng":
        torch.manual_seed(0)
        model = DropoutMLP()
    for name, p in model.named_parameters():
        if "frozen" in flags and any(fnmatch.fnmatchcase(name, g) for g in FROZEN):
            p.requires_grad_(False)
    batches = [batch, _other(batch)]
    ref = Reference(model, options.get("precision", "fp32"))
    cluster = autopar.Cluster.local(world, mesh_shape=mesh)
    pm = autopar.compile(model, cluster, batch, **options)
    loss_err = IDIOMS[idiom](pm, ref, batches)
    full = pm.full_state_dict()
    errors = {k: rel(full[k], v) for k, v in ref.model.state_dict().items() if k in ref.moved}
    worst = max(errors, key=errors.get, default=None)  # None: no step was taken (a refused case)
    return {"loss_err": loss_err, "param_err": errors.get(worst, 0.0), "worst_param": worst, "compared": len(errors),
            "loss": loss_err, "zero": sorted({lvl for s in pm.plan.stages for lvl in s.zero.values()}),
            "stages": len(pm.plan.stages), "virtual_stages": pm.plan.virtual_stages,
            "norms": ref.norms, "refused": ref.refused, "lrs": getattr(ref, "lrs", None),
            "frozen_equal": _frozen_equal(model, full), "losses": getattr(ref, "losses", None),
            "repeat": getattr(ref, "repeat", None), "own_draws": getattr(ref, "own_draws", None),
            "dropout_on": getattr(ref, "dropout_on", None),
            "sharded_params": sum(1 for s in pm.plan.stages for n, sh in s.shardings.items()
                                  if n.startswith("p_") and "S" in sh.out)}


def _frozen_equal(model, full: dict) -> bool | None:
    """Whether every frozen parameter came out as it went in (None: nothing frozen)."""
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    return all(torch.equal(full[n], dict(model.named_parameters())[n]) for n in frozen) if frozen else None


def sabotage(kind) -> callable:
    """Negative controls (see module docstring); returns the undo."""
    if kind == "old_sync":
        original = gradsync.Bucket.begin

        def old_begin(self):  # the sync before it kept what a rank held: reduced again, or overwritten
            if self.level <= 1:
                self._grads_as_views()
            elif self.shard.grad is not None:
                self.grad_shard.zero_()
        gradsync.Bucket.begin = old_begin
        original_take = gradsync.take_shared
        gradsync.take_shared = lambda gm, shared: {}  # tied parameters: the held gradient summed again

        def undo():
            gradsync.Bucket.begin, gradsync.take_shared = original, original_take
        return undo
    if kind == "one_group":  # pm.optimizer ignoring param_groups: every parameter decays
        from autopar.runtime import optim

        original_groups = optim.named_groups
        optim.named_groups = lambda named, groups: [{"params": list({id(t): t for t in named.values()}.values())}]
        return lambda: setattr(optim, "named_groups", original_groups)
    if kind == "no_rng":  # the module runs on each rank's own generator, and checkpoints carry no stream
        from autopar.runtime import checkpoint, rng

        original_active, original_restore = rng.ModuleRng.active, checkpoint._restore_rng
        rng.ModuleRng.active = lambda self: contextlib.nullcontext()
        checkpoint._restore_rng = lambda *args: None

        def undo_rng():
            rng.ModuleRng.active, checkpoint._restore_rng = original_active, original_restore
        return undo_rng
    if kind == "no_eval":  # pm.eval() that leaves the generated modules in training mode
        from autopar.runtime import modes

        original_set = modes.set_training
        modes.set_training = lambda runner, mode: 0
        return lambda: setattr(modes, "set_training", original_set)
    if kind == "no_adopt":  # a plain optimizer stepping the parameters instead of this rank's ZeRO shards
        from autopar.runtime import plain_optim

        original_adopt = plain_optim.adopt
        plain_optim.adopt = lambda optimizer: [r for r in {id(getattr(p, "_autopar_runner", None)): getattr(
            p, "_autopar_runner", None) for g in optimizer.param_groups for p in g["params"]}.values() if r is not None]
        return lambda: setattr(plain_optim, "adopt", original_adopt)
    if kind == "local_norm":  # each rank clips by the norm of its own gradients (torch's call, unrouted)
        original_faults = clipping.faults
        clipping.faults = types.SimpleNamespace(guard=lambda *args, **kwargs: None)
        return lambda: setattr(clipping, "faults", original_faults)
    return lambda: None
