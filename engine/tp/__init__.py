"""Multi-rank workers: a worker started with `--tp N` runs N processes, one per GPU.

  group.py     RankGroup: spawning followers, the process groups, byte collectives, failure handling
  messages.py  Command enum and the typed messages of the control plane
  step.py      STEP's page protocol (rank 0 encoder, follower mirror)
  local_kv.py  one rank's KV endpoint driven by commands (the same code on every rank)
  proxies.py   rank 0's runner / KVSender / KVReceiver stand-ins that the engines call
  follower.py  the follower process and its loop
"""
