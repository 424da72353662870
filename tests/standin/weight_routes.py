"""The stand-in's weight-update routes, as SGLang's scheduler runs them: one control request at a
time (`state.scheduler`), distributed / tensor / disk updates under the writer side of the
model-update lock (they wait for the generations in flight), replies {"success", "message"} with
HTTP 400 when success is false.

From 0.5.21 (the release has /begin_weight_update): /update_weights_from_distributed and
/update_weights_from_tensor outside a session are refused before anything is received; a second
begin, or an end without begin, is refused; `selector` ("all" | "target" | "draft") picks the runners
that load the tensors (the draft runner exists with --speculative-algorithm; selecting only roles
the server lacks loads nothing and succeeds, as SGLang's empty runner list does).
/update_weights_from_disk needs no session in any release.

Which runners an update reaches before 0.5.21 (no selector), as the releases' schedulers do:
/update_weights_from_distributed only the target (`self.tp_worker.update_weights_from_distributed`:
the drafter keeps its launch weights), /update_weights_from_tensor the drafter and then the target with
the same tensors (`self.draft_worker or self.tp_worker`; from 0.5.11 `disable_draft_model` skips the
drafter), /update_weights_from_disk both. Each runner keeps the names its model loads (draft.py,
model.py `accepts`): the Qwen3-MoE target skips `mtp.*`, its drafter takes only `mtp.*`; the toy
model's runners keep every name.
"""

from __future__ import annotations

from pathlib import Path

from tests.standin.state import RankError, Reply, State

ROLES = {"all": ("target", "draft"), "target": ("target",), "draft": ("draft",)}


def _fail(message: str, **extra) -> None:
    raise Reply(400, {"success": False, "message": message, **extra})


def _roles(st: State, path: str, body: dict) -> tuple[str, ...]:
    """The runners an update loads into (module docstring)."""
    fields = st.proto.request_fields(path) or {}
    if "selector" in fields:
        return ROLES[body.get("selector", "all")]
    if path == "/update_weights_from_distributed":
        return ("target",)
    if path == "/update_weights_from_tensor" and body.get("disable_draft_model"):
        return ("target",)
    return ROLES["all"]


def _require_session(st: State, op: str) -> None:
    if st.has_sessions and st.session is None:
        _fail(f"{op} must run between begin_weight_update() and end_weight_update()")


def _apply(st: State, per_rank: list[dict], *, roles: tuple[str, ...], weight_version) -> None:
    """Keep every rank's tensors under the selected roles (the names each role's model loads) and load
    TP rank 0's into the models."""
    roles = [r for r in roles if r in st.role_weights]
    models = {role: st.model if role == "target" else st.draft for role in roles}
    for model in models.values():
        problem = model.check(per_rank[0]) if hasattr(model, "check") else None
        if problem:
            _fail(f"Failed to update weights: {problem}")
    with st.lock:
        for role, model in models.items():
            keep = getattr(model, "accepts", lambda name: True)
            for r, named in enumerate(per_rank):
                st.role_weights[role][r].update({n: t for n, t in named.items() if keep(n)})
    for model in models.values():
        if model is not None and hasattr(model, "load"):
            model.load(per_rank[0])
    if "target" in roles:
        st.stale.difference_update(per_rank[0])
    with st.lock:
        if st.session is not None:
            st.session["loaded"] = True
        if weight_version is not None:
            st.weight_version = weight_version


def init_group(st: State, body: dict, query):
    if body.get("backend", "nccl") != "gloo":
        _fail(f"Failed to init process group: the stand-in runs on CPU, backend must be 'gloo', "
              f"got {body.get('backend', 'nccl')!r}")
    body.setdefault("group_name", "weight_update_group")
    with st.scheduler:
        try:
            st.get_ranks().init_group(body)
        except (RankError, ValueError) as e:
            _fail(f"Failed to init process group: {e}")
    return {"success": True, "message": "Succeeded to initialize custom process group."}


def destroy_group(st: State, body: dict, query):
    name = body.get("group_name", "weight_update_group")
    with st.scheduler:
        if not st.get_ranks().destroy_group(name):
            _fail(f"Failed to destroy weights update group: no group {name!r}")
    return {"success": True, "message": "Succeed to destroy custom process group."}


def from_distributed(st: State, body: dict, query):
    body.setdefault("group_name", "weight_update_group")
    with st.rw.write(), st.scheduler:
        _require_session(st, "update_weights_from_distributed")
        try:
            per_rank = st.get_ranks().receive(body)
        except (RankError, ValueError) as e:
            _fail(f"Failed to receive weights: {e}")
        _apply(st, per_rank, roles=_roles(st, "/update_weights_from_distributed", body),
               weight_version=body.get("weight_version"))
    return {"success": True, "message": "Succeeded to update parameter online."}


def from_tensor(st: State, body: dict, query):
    entries = body["serialized_named_tensors"]
    with st.rw.write(), st.scheduler:
        _require_session(st, "update_weights_from_tensor")
        if len(entries) < st.get_ranks().tp_size:  # serialized_named_tensors[tp_rank] in each TP worker
            st.crash("update_weights_from_tensor", IndexError(
                f"list index out of range ({len(entries)} entries, tp_size={st.get_ranks().tp_size})"))
        try:
            per_rank = st.get_ranks().open_serialized(entries[: st.get_ranks().tp_size], body.get("load_format"))
        except RankError as e:
            st.crash("update_weights_from_tensor", e.error)
        _apply(st, per_rank, roles=_roles(st, "/update_weights_from_tensor", body),
               weight_version=body.get("weight_version"))
    return {"success": True, "message": "Succeeded to update model weights."}


def from_disk(st: State, body: dict, query):
    path = body["model_path"]
    with st.rw.write(), st.scheduler:
        if not st.args.toy:
            files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
            if not files:
                _fail(f"Failed to get weights iterator: no safetensors under {path!r}", num_paused_requests=0)
            from safetensors.torch import load_file

            named = {}
            for f in files:
                named.update(load_file(str(f)))
            _apply(st, [named] * st.get_ranks().tp_size, roles=ROLES["all"], weight_version=None)
        if body.get("weight_version") is not None:
            st.weight_version = body["weight_version"]
    return {"success": True, "message": f"Succeeded to update model weights from {path}.", "num_paused_requests": 0}


def begin(st: State, body: dict, query):
    with st.rw.write(), st.scheduler:
        if st.session is not None:
            _fail("a weight-update session is already open; call end_weight_update() first")
        st.session = {"selector": body.get("selector", "all"), "loaded": False}
    return {"success": True, "message": "Success"}


def end(st: State, body: dict, query):
    with st.rw.write(), st.scheduler:
        if st.session is None:
            _fail("no weight-update session is open; call begin_weight_update() first")
        st.session = None
    return {"success": True, "message": "Success"}


def get_weights_by_name(st: State, body: dict, query):
    name = body["name"]
    t = st.role_weights["target"][0].get(name)
    if t is None and hasattr(st.model, "targets") and name in st.model.targets:
        p, index = st.model.targets[name]
        t = p[index] if index else p
    if t is None:
        raise Reply(400, {"error": {"message": f"Get parameter by name failed: no parameter {name!r}"}})
    return t.detach().flatten().float()[: body.get("truncate_size", 100)].tolist()


ROUTES = {
    "/init_weights_update_group": init_group,
    "/destroy_weights_update_group": destroy_group,
    "/update_weights_from_distributed": from_distributed,
    "/update_weights_from_tensor": from_tensor,
    "/update_weights_from_disk": from_disk,
    "/begin_weight_update": begin,
    "/end_weight_update": end,
    "/get_weights_by_name": get_weights_by_name,
}
