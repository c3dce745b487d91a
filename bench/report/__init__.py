"""Reporting: leaderboards, claims, tables, HTML and plots regenerated from stored records alone.

Layers, imports pointing down only: ``stats`` (estimates, bootstrap) <- ``results`` (loading, selection)
<- ``audit`` (epsilon audit of a row) <- ``tables`` / ``claims`` / ``reported`` / ``table4`` / ``charts``
<- ``markdown`` / ``plots`` <- ``html`` <- ``leaderboards`` (``write_leaderboards``). Nothing in the run-time
harness imports this package (``lbcache``: the entry point's check whether the leaderboards are up to date).
"""
