"""Business logic: plain functions that entry points (stanza handlers, views, tasks) call."""
