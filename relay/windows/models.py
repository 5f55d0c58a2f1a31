"""The Windows API's data: the devices, and which of the core's registrations are their accounts."""

from __future__ import annotations

from django.db import models


class WnsDevice(models.Model):
    """A Windows (UWPX-style) device registered over the HTTP API; its accounts are registrations.

    The device id is the client's only capability, so only its SHA-256 is stored.
    """

    app = models.ForeignKey("relay.App", on_delete=models.CASCADE, related_name="wns_devices")
    device_id_hash = models.CharField(max_length=64)
    channel_uri = models.TextField()
    created = models.DateTimeField(auto_now_add=True)
    updated = models.DateTimeField(auto_now=True, help_text="Last time the client updated it.")

    class Meta:
        # The table (and its index and constraint) keep the names they had in the core.
        db_table = "relay_wnsdevice"
        constraints = [
            models.UniqueConstraint(
                fields=["app", "device_id_hash"], name="wnsdevice_unique_device_per_app"
            )
        ]
        indexes = [models.Index(fields=["updated"], name="relay_wnsde_updated_5bf6d9_idx")]

    def __str__(self) -> str:
        return f"WNS device {self.device_id_hash[:12]}"


class WnsAccount(models.Model):
    """One account of a device: the core's registration it is.

    The link lives here, not on the registration, so the core names no feature; a device's
    accounts are removed with it by relay.windows.services, which logs their removal."""

    registration = models.OneToOneField(
        "relay.Registration",
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="wns_account",
    )
    device = models.ForeignKey(WnsDevice, on_delete=models.CASCADE, related_name="accounts")

    def __str__(self) -> str:
        return f"{self.device} account {self.registration_id}"
