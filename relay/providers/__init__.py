"""Push provider clients, one module each, behind `relay.providers.base.PushProvider`."""
