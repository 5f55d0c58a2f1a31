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
    # Body bytes of the messages handed to the phone (UnifiedPush; 0 for the wake-ups).
    "bytes_relayed",
)

# The provider value of UnifiedPush messages (the Matrix gateway's notifications included).
UNIFIEDPUSH = "up"

# How a UnifiedPush message ended (relay_unifiedpushdelivery.outcome), in report order.
UNIFIEDPUSH_OUTCOMES = ("delivered", "expired", "revoked", "replaced", "withdrawn", "dropped")
