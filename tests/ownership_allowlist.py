"""The ownership ratchet: every finding of tests/ownership.py in today's code, as
(module, class, attr, kind). tests/test_ownership.py fails on a finding not listed here
and on an entry no longer found, so the list only shrinks: delete the entries a change
fixes (regenerate: `PYTHONPATH=$PWD python -m tests.ownership --write`)."""

ALLOWLIST = {
    ("hybrid_opt.lifetime", "<module>", "obj.__dict__", "foreign-dict"),
    ("hybrid_opt.lifetime", "<module>", "opt.__dict__", "foreign-dict"),
    ("hybrid_opt.optimizer", "_HybridBase", "found_inf", "lazy-getattr"),
    ("hybrid_opt.optimizer", "_HybridBase", "grad_scale", "lazy-getattr"),
    ("hybrid_opt.worker.client", "WorkerClient", "task.task_id", "foreign-write"),
    ("hybrid_opt.worker.main", "Worker", "r.elapsed_ns", "foreign-write"),
}
