"""A sync group led by trainer rank 0, without Ray: for frameworks that run their own processes.

vLLM's trainer-side weight-transfer API and verl's checkpoint engines call
into every trainer rank (and, for verl, every rollout rank) themselves;
no Ray actor of rl-sync's can reach those processes. So trainer rank 0 plays
the coordinator's part in process (`Leader`): it hosts the group's
rendezvous store, plans with the same pure planner (`rl_sync.planning`),
and reaches every other rank through one seam, `ServiceDriver`
(`rl_sync.vllm.driver`): a vLLM engine through vLLM's own calls, and ranks in
processes of their own (the other trainer ranks, a framework's rollout
ranks) through posts in the store (`board`), which each such rank follows
(`follower`) and answers (`handler`). The ranks themselves are the same
`TrainerRank` / `WorkerRank` as everywhere else.

Typical use (trainer rank 0)::

    leader = Leader(rank, config, secret)
    summary = leader.form(trainers=2, workers=driver)     # plan and connect every rank
    stats = leader.push()            # one round
"""
