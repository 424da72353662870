"""The SGLang rollout engine, one module per concern; nothing here imports sglang (servers run in their
own processes, spoken to over HTTP and a weight-update process group).

- `engine`: the HTTP client (`SGLangEngine`, a `RolloutEngine`): its construction and generation requests.
- `control`: the engine's control routes (`ServerControl`): connect, abort, pause, memory, health, updates.
- `server`: the launch command, the server processes and their health wait.
- `versions`: the supported releases and what differs between them (read from the wheels).
- `payloads`: request and reply layouts of /generate and the control routes.
- `weights`: weight-update buckets and payloads, the weight-update process group.
- `sync`: the trainer's weight sync to every server (every stage, every tensor).
- `drafter`: how the sync treats the MTP drafter per release.
- `autospec`: with / without speculative decoding, measured and chosen.
- `placement`: servers as Ray actors on the cluster.
"""
