"""Routing policies: filters -> weighted scorers -> one picker, plus hooks.

Scoring is pure: filters and scorers read a `RoutingInputs` snapshot and never mutate
anything. Side effects (recording the pick in the prefix index, the session table)
happen in hooks the gateway calls after the decision. This package knows nothing of
HTTP and never parses OpenAI bodies: it reads the `RequestContext` the gateway built.
"""
