-- Prosody 0.12 for bench/unifiedpush.py: one server routes both sides of the comparison.
--   up.localhost   our relay's component (XEP-0114): the gateway connects here
--   upm.localhost  Prosody's own mod_unified_push (prosody-modules), `storage` backend,
--                  its push resource on HTTP_PORT
-- Loopback only, no TLS, logs at "warn" (per-stanza debug logging would measure logging).
local lab = assert(ENV_PROSODY_LAB, "set PROSODY_LAB to a writable folder")

run_as_root = true
pidfile = lab.."/prosody.pid"
data_path = lab.."/data"
certificates = lab.."/certs"
plugin_paths = { "/usr/lib/prosody/modules" }

interfaces = { "127.0.0.1" }
c2s_ports = { tonumber(ENV_C2S_PORT) }
c2s_interfaces = { "127.0.0.1" }
component_ports = { tonumber(ENV_COMPONENT_PORT) }
component_interfaces = { "127.0.0.1" }
http_ports = { tonumber(ENV_HTTP_PORT) }
http_interfaces = { "127.0.0.1" }
http_default_host = "upm.localhost"
http_external_url = "http://127.0.0.1:"..ENV_HTTP_PORT.."/"
https_ports = {}
modules_disabled = { "s2s", "s2s_auth_certs" }

c2s_require_encryption = false
allow_unencrypted_plain_auth = true
authentication = "internal_hashed"
storage = "internal"

allow_registration = true
min_seconds_between_registrations = 0
registration_throttle_max = 100000

modules_enabled = { "roster"; "saslauth"; "disco"; "register"; "ping" }

log = {
  { levels = { min = "warn" }, to = "file", filename = lab.."/prosody.log" };
  { levels = { min = "info" }, to = "console" };
}

VirtualHost "localhost"

Component "up.localhost"
  component_secret = ENV_COMPONENT_SECRET

Component "upm.localhost" "unified_push"
  unified_push_backend = "storage"
