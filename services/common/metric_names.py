"""Every metric name the tiers export: the contract dashboards, HPA rules, the benchmark and the
tests read. Renaming one breaks deploy/ (grafana, prometheus-adapter), so names only ever grow.

Histograms export `<name>_bucket`, `<name>_sum` and `<name>_count`; counters are named with
their `_total` suffix, as scraped.
"""

from __future__ import annotations

#: Bucket bounds (seconds) of the worker's latency histograms; the HPA's p90 queue wait
#: (deploy/k8s/prometheus-adapter) interpolates within them, and so does the simulator's.
#: Bounds every 50-100 ms from 0.1 to 0.5 s, where SLOs lie, as the other tiers' histograms.
WORKER_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.0, 2.5, 5.0,
)  # fmt: skip

# Every tier.
BUILD_INFO = "inference_build_info"
PROCESS_RESIDENT_MEMORY_BYTES = "process_resident_memory_bytes"
PROCESS_CPU_SECONDS_TOTAL = "process_cpu_seconds_total"
PROCESS_OPEN_FDS = "process_open_fds"
#: How late the process's event loop ran a timer that was due (services.common.loop_lag).
EVENT_LOOP_LAG_SECONDS = "inference_event_loop_lag_seconds"
EVENT_LOOP_LAG_RECENT_SECONDS = "inference_event_loop_lag_recent_seconds"
#: The door's concurrency limit (services.common.door): refusals, the limit, calls in flight and
#: the probed delay of the queue in front of the process, whether it sheds.
DOOR_REFUSED_TOTAL = "inference_door_refused_total"
DOOR_LIMIT = "inference_door_limit"
DOOR_SHEDDING = "inference_door_shedding"
DOOR_IN_FLIGHT = "inference_door_in_flight"
DOOR_QUEUE_DELAY_SECONDS = "inference_door_queue_delay_seconds"
DOOR_PROBES_DROPPED_TOTAL = "inference_door_probes_dropped_total"

# Gateway.
GATEWAY_REQUESTS_TOTAL = "inference_gateway_requests_total"
GATEWAY_INPUTS_TOTAL = "inference_gateway_inputs_total"
GATEWAY_VALIDATE_SECONDS = "inference_gateway_validate_seconds"
GATEWAY_TOKENIZE_SECONDS = "inference_gateway_tokenize_seconds"
GATEWAY_REQUEST_SECONDS = "inference_gateway_request_seconds"
GATEWAY_THROTTLED_TOTAL = "inference_gateway_throttled_total"
GATEWAY_THROTTLE_PROBABILITY = "inference_gateway_throttle_probability"
GATEWAY_MODEL_READY_VERSIONS = "inference_gateway_model_ready_versions"
GATEWAY_ROUTER_RETRIES_TOTAL = "inference_gateway_router_retries_total"
GATEWAY_BUNDLE_SLICES = "inference_gateway_bundle_slices"
GATEWAY_BUNDLE_HOLD_SECONDS = "inference_gateway_bundle_hold_seconds"
GATEWAY_TENANT_REQUESTS_TOTAL = "inference_gateway_tenant_requests_total"
GATEWAY_TENANT_ROWS_TOTAL = "inference_gateway_tenant_rows_total"
GATEWAY_TENANT_REFUSED_TOTAL = "inference_gateway_tenant_refused_total"
GATEWAY_UNAUTHENTICATED_TOTAL = "inference_gateway_unauthenticated_total"
GATEWAY_KEYS_FILE_REFUSED = "inference_gateway_keys_file_refused"
GATEWAY_TENANT_REQUEST_SECONDS = "inference_gateway_tenant_request_seconds"
GATEWAY_TENANT_QUOTA_SHARE = "inference_gateway_tenant_quota_share"
#: Served by the supervisor of a gateway process group (--processes > 1).
GATEWAY_PROCESS_RESTARTS_TOTAL = "inference_gateway_process_restarts_total"

# Router.
ROUTER_ROUTED_TOTAL = "inference_router_routed_total"
ROUTER_REJECTED_TOTAL = "inference_router_rejected_total"
ROUTER_SPLIT_BUNDLES_TOTAL = "inference_router_split_bundles_total"
ROUTER_RETRIES_TOTAL = "inference_router_retries_total"
ROUTER_RETRIES_GIVEN_UP_TOTAL = "inference_router_retries_given_up_total"
ROUTER_RETRY_BUDGET_TOKENS = "inference_router_retry_budget_tokens"
ROUTER_RESPONSES_TOTAL = "inference_router_responses_total"
ROUTER_PREDICTED_WAIT_SECONDS = "inference_router_predicted_wait_seconds"
ROUTER_REQUEST_SECONDS = "inference_router_request_seconds"
ROUTER_REGISTRY_DEGRADED = "inference_router_registry_degraded"
ROUTER_REGISTRY_SNAPSHOT_AGE_SECONDS = "inference_router_registry_snapshot_age_seconds"
ROUTER_LIVE_WORKERS = "inference_router_live_workers"
ROUTER_WORKER_LINKS = "inference_router_worker_links"
ROUTER_REJECTED_WORKER_RECORDS_TOTAL = "inference_router_rejected_worker_records_total"
ROUTER_EJECTIONS_TOTAL = "inference_router_ejections_total"

# GPU worker fronts (--front-processes > 0): the restarts are the engine's; the rest each
# front's, labelled worker_front in the worker's /metrics.
WORKER_FRONT_RESTARTS_TOTAL = "inference_worker_front_restarts_total"
WORKER_FRONT_STREAMS_TOTAL = "inference_worker_front_streams_total"
WORKER_FRONT_OPEN_STREAMS = "inference_worker_front_open_streams"
WORKER_FRONT_CALLS_TOTAL = "inference_worker_front_calls_total"

# GPU worker: requests, batching and per-row stages.
WORKER_REQUESTS_TOTAL = "inference_worker_requests_total"
WORKER_ROWS_TOTAL = "inference_worker_rows_total"
WORKER_BATCHES_TOTAL = "inference_worker_batches_total"
WORKER_BATCH_SIZE = "inference_worker_batch_size"
WORKER_BATCH_FILL_RATIO = "inference_worker_batch_fill_ratio"
WORKER_MIXED_BUCKET_BATCHES_TOTAL = "inference_worker_mixed_bucket_batches_total"
WORKER_PADDING_WASTE_RATIO = "inference_worker_padding_waste_ratio"
WORKER_LINGER_SECONDS = "inference_worker_linger_seconds"
WORKER_BACKLOG_SECONDS = "inference_worker_backlog_seconds"
WORKER_QUEUE_WAIT_SECONDS = "inference_worker_queue_wait_seconds"
WORKER_ROW_COMPUTE_SECONDS = "inference_worker_row_compute_seconds"
WORKER_ROW_LATENCY_SECONDS = "inference_worker_row_latency_seconds"
WORKER_COMPUTE_SECONDS = "inference_worker_compute_seconds"
#: The device's own time on batches (CUDA events on a GPU): its rate is the duty cycle.
WORKER_DEVICE_BUSY_SECONDS_TOTAL = "inference_worker_device_busy_seconds_total"
#: Its `work` label: batches with online rows (generation steps too), and backfill batches of
#: batch-class rows only (which fill idle time and must not scale workers up).
WORK_ONLINE, WORK_BACKFILL = "online", "backfill"
WORKER_TENANT_COMPUTE_SECONDS_TOTAL = "inference_worker_tenant_compute_seconds_total"
WORKER_TENANT_TOKENS_TOTAL = "inference_worker_tenant_tokens_total"
WORKER_REJECTED_TOTAL = "inference_worker_rejected_total"
WORKER_DROPPED_TOTAL = "inference_worker_dropped_total"
WORKER_ROW_FAILURES_TOTAL = "inference_worker_row_failures_total"
WORKER_MAX_WAIT_SECONDS = "inference_worker_max_wait_seconds"
WORKER_MAX_BATCH_SIZE = "inference_worker_max_batch_size"
WORKER_LATENCY_SLOWDOWN = "inference_worker_latency_slowdown"
WORKER_LATENCY_SPREAD = "inference_worker_latency_spread"
WORKER_QUEUE_DEPTH = "inference_worker_queue_depth"
WORKER_QUEUE_STANDING = "inference_worker_queue_standing"
#: 1 while a version's batches all fail on the worker (batching.failure_streak).
WORKER_MODEL_FAILING = "inference_worker_model_failing"
#: The executor's idle time between batches while rows wait (batching.batch_gap).
WORKER_BATCH_GAP_SECONDS = "inference_worker_batch_gap_seconds"
WORKER_WATCHDOG_EXPIRED_TOTAL = "inference_worker_watchdog_expired_total"
WORKER_DEVICE_LOST_TOTAL = "inference_worker_device_lost_total"
WORKER_MODEL_LOAD_FAILURES_TOTAL = "inference_worker_model_load_failures_total"

# GPU worker: generation (continuous batching).
GENERATION_TTFT_SECONDS = "inference_generation_time_to_first_token_seconds"
GENERATION_TPOT_SECONDS = "inference_generation_time_per_output_token_seconds"
GENERATION_STEP_SECONDS = "inference_generation_step_seconds"
GENERATION_STEP_TOKENS = "inference_generation_step_tokens"
GENERATION_KV_BLOCKS_FREE = "inference_generation_kv_blocks_free"
GENERATION_KV_BLOCKS_USED = "inference_generation_kv_blocks_used"
GENERATION_RUNNING_SEQUENCES = "inference_generation_running_sequences"
GENERATION_WAITING_SEQUENCES = "inference_generation_waiting_sequences"
GENERATION_PREEMPTIONS_TOTAL = "inference_generation_preemptions_total"
GENERATION_PREFIX_CACHE_QUERIED_TOKENS_TOTAL = (
    "inference_generation_prefix_cache_queried_tokens_total"
)
GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL = "inference_generation_prefix_cache_hit_tokens_total"
GENERATION_PREFIX_CACHE_BLOCKS = "inference_generation_prefix_cache_blocks"
GENERATION_TOKENS_TOTAL = "inference_generation_tokens_total"
GENERATION_ATTENTION_BACKENDS = "inference_generation_attention_backends"
GENERATION_CUDA_GRAPHS = "inference_generation_cuda_graphs"
GENERATION_FINISHED_TOTAL = "inference_generation_finished_total"
GENERATION_CANCELLED_TOTAL = "inference_generation_cancelled_total"
GENERATION_REJECTED_TOTAL = "inference_generation_rejected_total"
GENERATION_DROPPED_TOTAL = "inference_generation_dropped_total"
GENERATION_QUEUE_STANDING = "inference_generation_queue_standing"
#: 1 while a generation version's steps all fail on the worker (batching.failure_streak).
GENERATION_MODEL_FAILING = "inference_generation_model_failing"

# Job runners (durable batch jobs).
JOBS_ITEMS_TOTAL = "inference_jobs_items_total"
JOBS_ITEMS_RUNNING = "inference_jobs_items_running"
JOBS_QUEUE_ENTRIES = "inference_jobs_queue_entries"
JOBS_OLDEST_ENTRY_AGE_SECONDS = "inference_jobs_oldest_entry_age_seconds"
JOBS_CHUNK_SECONDS = "inference_jobs_chunk_seconds"
JOBS_RETRIES_TOTAL = "inference_jobs_retries_total"
JOBS_CHUNKS_HELD_FOR_ROOM = "inference_jobs_chunks_held_for_room"
JOBS_CHUNKS_LEFT_TOTAL = "inference_jobs_chunks_left_total"
#: `reason` values of JOBS_CHUNKS_LEFT_TOTAL: why a chunk was left pending for a later round.
CHUNK_LEFT_RUNNER_REFUSED = "runner_refused"
CHUNK_LEFT_FLEET_UNAVAILABLE = "fleet_unavailable"
CHUNK_LEFT_STORE_UNREACHABLE = "store_unreachable"

# Rollout controller (services.rollout)
ROLLOUT_CANARY_PERCENT = "inference_rollout_canary_percent"
ROLLOUT_DECISIONS_TOTAL = "inference_rollout_decisions_total"
#: Replicas the controller set on a canary pool's Deployment (services.rollout.cluster).
ROLLOUT_CANARY_REPLICAS = "inference_rollout_canary_replicas"
#: Ready pods of a canary pool at the controller's last look.
ROLLOUT_POOL_READY_PODS = "inference_rollout_pool_ready_pods"
