"""Spark reports over the delivery records (relay.models.Delivery) in a PostgreSQL replica.

Empty on purpose: the reporting work comes after the current issues. The records it will read
are already written per push, without JID, token or body (tenant, app, provider, publishing
domain, priority, received/queued/sent, outcome, error code, attempts, coalesced).
"""
