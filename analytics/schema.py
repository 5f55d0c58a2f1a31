"""Names shared by the reading, the computing and the loading of the reports (no Spark here:
the writer imports it too)."""

# What every report counts, per day and key: the columns of the facts, of the usage report and
# of the primary's relay_reportusage table alike.
COUNT_COLUMNS = (
    "publishes_received",
    "pushes_sent",
    "delivered",
    "dead_tokens",
    "retried",
    "failed",
    "coalesced",
    "rate_limited",
    "refused",
    "unavailable",
)
