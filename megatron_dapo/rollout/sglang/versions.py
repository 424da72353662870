"""The SGLang releases the client supports and what differs between them: one table, read from the
release wheels (tools/sglang_protocol.py extracts the evidence into tests/assets/sglang/).

`SGLangEngine` reads the server's version from /server_info at connect and refuses a release
outside SUPPORTED with UnsupportedSGLangVersion; everything release-dependent it does goes through
`features_for(version)`.

What the wheels show (release = first one with the change):

- 0.5.5: `sampling_seed` becomes a sampling parameter, honoured only when the server runs with
  --enable-deterministic-inference (new then); /destroy_weights_update_group appears; speculative
  counters are spec_verify_ct, spec_accept_rate, spec_accept_length only.
- 0.5.8: /model_info and /server_info (/get_model_info and /get_server_info stay, deprecated, and log
  a warning per call); speculative counters spec_draft_token_num (proposed) and
  spec_accept_token_num (accepted), present only after a verify step. Lower bound: before 0.5.8
  the counters of accepted and proposed drafts do not exist.
- 0.5.8 (first in 0.5.7; 0.5.6 has none): routed experts ("R3", rollout routing replay). Read from the
  0.5.8 to 0.5.14 and 0.5.23 wheels (paths under sglang/srt), and run on a CPU 0.5.23 server (its
  pinned host buffer calls cudaHostRegister, mem_cache/pool_host/common.py:147, which a CPU torch
  refuses: the test venv allocates it plainly, tests/sglang_env/megatron_dapo_host_alloc.py).
  Request: `return_routed_experts: true` (GenerateReqInput, 0.5.8 managers/io_struct.py:204,
  0.5.23 :264); the server needs the launch switch --enable-return-routed-experts (ROUTED_EXPERTS_FLAG;
  0.5.8 server_args.py:4407, 0.5.23 arg_groups/fields/exec_.py:158), reported as
  `enable_return_routed_experts` in /server_info. Reply: `meta_info["routed_experts"]`, a base64 str of
  the raw bytes of a C-order int32 tensor [tokens, num_hidden_layers, num_experts_per_tok] (token-major,
  layers second; 0.5.8 layers/moe/routed_experts_capturer.py:78-86 (host buffer), :211-219, and
  detokenizer_manager.py:329-342; 0.5.23 state_capturer/base.py:64-72, :173-187, detokenizer_manager.py:
  432-448; SGLang's own reader, extract_routed_experts_from_meta_info, is np.frombuffer(..., int32)).
  Rows: the positions [0, prompt + completion - 1) of the finished request: every prompt token and every
  response token but the last, which is sampled and never fed forward (0.5.8 scheduler_output_processor_
  mixin.py:66-71 with Req.seqlen = prompt + output ids, schedule_batch.py:782; 0.5.23 scheduler_components/
  batch_result_processor.py:136-178). Prompt rows are included (prefix-cache hits keep the routing of the
  request that computed them: the buffer is indexed by KV slot). A layer without a router (dense layers of
  a mixed model) keeps zeros; the ids are logical experts in 0.5.23 (layers/moe/topk.py:2574 captures
  before the logical-to-physical map) and the physical ones in 0.5.8 (topk.py:1045, after it): equal
  without --ep-num-redundant-experts. `routed_experts_start_len` (start row) is accepted from 0.5.8 but
  honoured only from 0.5.12 (state_capturer/base.py: `[start_len : seqlen - 1]`); the client never sends it.
  Routing is collected when the request finishes, so with stream=true only the last chunk carries it; a
  request aborted while it runs finishes through the same step and carries the routing of what it
  computed, one aborted before it was scheduled carries none. Without the launch switch nothing is
  captured and nothing refused: 0.5.8 and 0.5.9 reply `"routed_experts": null` (tokenizer_manager.py:1537),
  0.5.10+ omit the key (0.5.23 tokenizer_manager.py:2602-2609). Each release's protocol JSON holds the
  field, the key and the switch (`request_classes`, `meta_info_keys`, `launch_flags`).
- 0.5.11: the counters are renamed spec_proposed_drafts / spec_accepted_drafts.
- 0.5.12: renamed again, spec_num_proposed_drafts / spec_num_correct_drafts (the 0.5.11 names stay
  as aliases through 0.5.20, gone in 0.5.21).
- 0.5.13: an MTP drafter for Qwen3-MoE (sglang/srt/models/qwen3_moe_mtp.py, Qwen3MoeForCausalLMMTP;
  configs/model_config.py rewrites a draft Qwen3MoeForCausalLM to it). It is the only MTP drafter
  SGLang has for the Qwen families megatron_dapo trains: Qwen2 / Qwen3 dense have none (qwen2_eagle.py
  is an EAGLE head of another shape: fc with bias, no pre-fc norms, no final norm), so speculative
  decoding from their MTP layers is impossible. SGLang defaults --speculative-draft-model-path only
  for DeepSeek-style checkpoints: the launcher passes the model path.
- 0.5.21: /begin_weight_update ... /end_weight_update sessions; /update_weights_from_distributed and
  /update_weights_from_tensor outside one are refused with HTTP 400 (/update_weights_from_disk is
  not); begin and both updates take `selector` ("all" | "target" | "draft": the drafter runner).
  A distributed update now reaches the drafter: the target's runner receives the broadcast and every
  selected runner loads it (scheduler_components/weight_updater.py). Before, it went to the target
  alone (`self.tp_worker.update_weights_from_distributed`): the drafter kept its launch weights.
  Tensor updates reach the drafter in every supported release (`self.draft_worker or self.tp_worker`,
  whose update loads the drafter and then the target with the same tensors; 0.5.21+: the selector).
  Each model keeps its own names: Qwen3MoeForCausalLM skips names containing "mtp", its drafter
  keeps only those (models/hf.py names the MTP tensors for it).
- 0.5.22: unknown sampling parameters are refused with HTTP 400 by the JSON contract (before: HTTP
  500 from SamplingParams(**params)); unknown request fields stay ignored in every release.

Every release in the range reports `version` and `context_length` (the --context-length launch
setting, None when not given) in /server_info, and `max_req_input_len` (scheduler info), from which
the longest request follows. Read from the 0.5.8, 0.5.16 and 0.5.23 wheels and measured on a real
0.5.23 server: the scheduler's `max_req_len = min(context_len - 1, KV pool tokens - 1)` (context_len:
--context-length, else the model's max_position_embeddings), `max_req_input_len = max_req_len - 5`;
a request's max_new_tokens is cut silently to `max_req_len - 1 - prompt` (managers/scheduler.py), and
the tokenizer manager refuses only `prompt + max_new_tokens > context_len`. So prompt + max_new_tokens
must stay within `max_req_input_len + 4` (= min(context_len, KV pool) - 2), whatever the launch flags:
`request_token_limit`. A server launched for L tokens needs --context-length L + 2 (SERVER_RESERVED_TOKENS).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from megatron_dapo.rollout.base import RolloutEngineError

SUPPORTED = ("0.5.8", "0.5.23")
"""Oldest and newest SGLang release the client is tested against (inclusive)."""

SELECTORS = ("all", "target", "draft")


class UnsupportedSGLangVersion(RolloutEngineError):
    """A server runs an SGLang release outside SUPPORTED (or reports no version)."""


@dataclass(frozen=True)
class ReleaseFeatures:
    """What the client does differently per release (see the module docstring)."""

    version: tuple[int, int, int]
    model_info_path: str = "/get_model_info"
    server_info_path: str = "/get_server_info"
    spec_proposed_key: str | None = None
    spec_accepted_key: str | None = None
    weight_update_session: bool = False
    update_selector: bool = False
    mtp_drafters: tuple[str, ...] = ()
    """HF model types whose MTP layer SGLang loads as the NEXTN / EAGLE drafter."""
    drafter_via_distributed: bool = False
    """/update_weights_from_distributed reaches the drafter (tensor updates always do)."""
    routed_experts: bool = False
    """/generate returns the MoE routing with `return_routed_experts` (servers launched with
    ROUTED_EXPERTS_FLAG): sglang/routing.py."""
    weight_version_spans: bool = False
    """meta_info.weight_versions: the output tokens each weight version produced, per request (a weight
    update while it ran). Earlier releases report only the version at the end."""


CHANGES: tuple[tuple[str, dict], ...] = (
    ("0.5.8", {"model_info_path": "/model_info", "server_info_path": "/server_info",
               "spec_proposed_key": "spec_draft_token_num", "spec_accepted_key": "spec_accept_token_num",
               "routed_experts": True}),
    ("0.5.11", {"spec_proposed_key": "spec_proposed_drafts", "spec_accepted_key": "spec_accepted_drafts"}),
    ("0.5.12", {"spec_proposed_key": "spec_num_proposed_drafts", "spec_accepted_key": "spec_num_correct_drafts"}),
    ("0.5.13", {"mtp_drafters": ("qwen3_moe",)}),
    ("0.5.19", {"weight_version_spans": True}),
    ("0.5.21", {"weight_update_session": True, "update_selector": True, "drafter_via_distributed": True}),
)
"""(release, the fields that change there): features_for folds every entry up to the version."""

SPEC_VERIFY_KEY = "spec_verify_ct"
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"
"""The launch switch without which a server captures no routing (the same in every release that has it)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of an SGLang version string ("0.5.8", "0.5.13.post1", "0.5.24.dev3+g1")."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)\.(\d+)", str(text))
    if m is None:
        raise UnsupportedSGLangVersion(f"cannot read an SGLang version from {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def features_for(version: str, *, where: str = "the server") -> ReleaseFeatures:
    """The features of `version`; UnsupportedSGLangVersion outside SUPPORTED."""
    v = parse_version(version)
    lo, hi = (parse_version(s) for s in SUPPORTED)
    if not lo <= v <= hi:
        raise UnsupportedSGLangVersion(
            f"{where} runs SGLang {version}; megatron_dapo supports SGLang {SUPPORTED[0]} to {SUPPORTED[1]} "
            "(docs/rollout.md, 'SGLang releases'): use a release in that range")
    features = ReleaseFeatures(version=v)
    for release, change in CHANGES:
        if v >= parse_version(release):
            features = dataclasses.replace(features, **change)
    return features


SERVER_RESERVED_TOKENS = 2
"""context_len - (the longest prompt + max_new_tokens a server generates in full): see the docstring."""


def request_token_limit(info: dict) -> int | None:
    """The longest prompt + max_new_tokens one server generates without cutting (the module docstring):
    from its scheduler's `max_req_input_len`, else its --context-length; None when it reports neither."""
    reported = info.get("max_req_input_len")
    if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0:
        return reported + 4
    ctx = info.get("context_length")
    if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > SERVER_RESERVED_TOKENS:
        return ctx - SERVER_RESERVED_TOKENS
    return None


def running_capacity(info: dict) -> int | None:
    """How many sequences one server decodes at once: the sum over its data-parallel schedulers of
    `internal_states[i].effective_max_running_requests_per_dp` (0.5.23: the scheduler's own limit,
    from --max-running-requests or the KV pool), else its --max-running-requests; None when it reports
    neither. Work beyond it waits in the server's queue."""
    def positive(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    states = info.get("internal_states")
    if isinstance(states, list) and states:
        per_dp = [st.get("effective_max_running_requests_per_dp") if isinstance(st, dict) else None for st in states]
        if all(positive(v) for v in per_dp):
            return sum(per_dp)
    cap = info.get("max_running_requests")
    return cap if positive(cap) else None


@dataclass(frozen=True)
class ServerFacts:
    """What the client learns at connect from the servers' /server_info."""

    version: str
    features: ReleaseFeatures
    context_length: int | None
    """The longest prompt + max_new_tokens every server generates in full (request_token_limit, the
    smallest over the servers); None when no server reports one."""
    seeds_honoured: bool
    """Every server runs with --enable-deterministic-inference (SGLang honours sampling_seed only then)."""
    capacities: tuple[int | None, ...] = ()
    """running_capacity of each server, in the order given."""


def server_facts(infos: list[tuple[str, dict]], *, require_deterministic: bool = False,
                 require_memory_saver: bool = False, require_routed_experts: bool = False) -> ServerFacts:
    """Check the (url, /server_info) of every server: one supported release, deterministic inference
    when `require_deterministic` (rollout.deterministic_inference) asks for it, the memory saver
    when `require_memory_saver` does (colocated servers: rollout.require_memory_saver), and routed
    experts (a release with them, servers launched with ROUTED_EXPERTS_FLAG) when `require_routed_experts`
    does (actor.router_replay)."""
    for url, info in infos:
        version = info.get("version")
        if not isinstance(version, str):
            raise UnsupportedSGLangVersion(f"{url}: /server_info reports no SGLang version ({version!r})")
        features_for(version, where=url)
    versions = {info["version"] for _, info in infos}
    if len(versions) > 1:
        listed = ", ".join(f"{u}: {i['version']}" for u, i in infos)
        raise UnsupportedSGLangVersion(f"the servers run different SGLang releases ({listed}); use one")
    version = versions.pop()
    limits = [v for v in (request_token_limit(i) for _, i in infos) if v is not None]
    off = [u for u, i in infos if i.get("enable_deterministic_inference") is not True]
    if require_deterministic and off:
        raise RolloutEngineError(
            f"rollout.deterministic_inference=true but {off} run without --enable-deterministic-inference: "
            "SGLang would ignore the sampling seeds; relaunch them with the flag")
    no_saver = [u for u, i in infos if i.get("enable_memory_saver") is not True]
    if require_memory_saver and no_saver:
        raise RolloutEngineError(
            f"rollout.mode=colocate but {no_saver} run without --enable-memory-saver: their weights and KV cache "
            "would stay in the accelerator memory the actor trains in; relaunch them with the flag, or set "
            "rollout.require_memory_saver=false when they do not share the trainer's accelerator memory")
    if require_routed_experts:
        check_routed_experts(infos, features_for(version))
    return ServerFacts(version=version, features=features_for(version), context_length=min(limits) if limits else None,
                       seeds_honoured=not off, capacities=tuple(running_capacity(i) for _, i in infos))


def check_routed_experts(infos: list[tuple[str, dict]], features: ReleaseFeatures) -> None:
    """RolloutEngineError unless the release returns routed experts and every server captures them."""
    if not features.routed_experts:
        version = ".".join(map(str, features.version))
        raise RolloutEngineError(
            f"actor.router_replay needs the MoE routing of each rollout, but the servers run SGLang {version}, "
            "which cannot return it (return_routed_experts: SGLang 0.5.8+, module docstring); use a newer "
            "release or turn actor.router_replay off")
    off = [u for u, i in infos if i.get("enable_return_routed_experts") is not True]
    if off:
        raise RolloutEngineError(
            f"actor.router_replay needs the MoE routing of each rollout, but {off} run without "
            f"{ROUTED_EXPERTS_FLAG}: SGLang would capture none and reply without it; relaunch them with the flag "
            "(SGLangServerSpec.return_routed_experts) or turn actor.router_replay off")
