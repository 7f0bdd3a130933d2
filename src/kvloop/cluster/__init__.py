"""Past one process: engine replicas behind a prefix-aware router (issue 17).

router.py  which replica a prompt goes to (pure: no Ray, no asyncio)
messages.py what a replica streams back besides outputs (accepted, refused, failed)
replica.py a replica's side of a request over its AsyncEngine; an in-process replica
stats.py   the replicas' figures summed into one SchedulerStats
pool.py    ReplicaPool: an EngineClient over replicas (routing, retries, health)
ray_serve.py the replicas as Ray Serve deployments (imported only when Ray is installed)
deploy.py  `--replicas N`: Ray present or one clear error, then the pool
"""
