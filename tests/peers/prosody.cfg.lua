-- Prosody 0.12 config for the real-peer test harness (tests/support/xmpp_servers.py).
-- Loopback only, no TLS, no s2s, in-band registration, mod_cloud_notify (XEP-0357) and
-- mod_smacks (XEP-0198) with short timers. Runs in the foreground: `prosody -F --config ...`.
--
-- Everything that varies per instance comes from environment variables (`ENV_X` reads $X,
-- a Prosody 0.12 config feature):
--   PROSODY_LAB           writable folder for data, pid file and log (required)
--   C2S_PORT              client port on 127.0.0.1
--   COMPONENT_PORT        XEP-0114 component port on 127.0.0.1
--   COMPONENT_COUNT       number of components N (default 1)
--   COMPONENT_<i>_JID     JID of component i (1..N)
--   COMPONENT_<i>_SECRET  secret of component i
--   PUSH_MAX_ERRORS       mod_cloud_notify push_max_errors (default 16)
--   PUSH_WITH_BODY        "1": real message body in pushes (default: privacy, no body)
--   PUSH_WITH_SENDER      "1": sender JID in pushes (default: privacy, no sender)
--   SMACKS_HIBERNATION    seconds a hibernated XEP-0198 session is kept (default 60)
--   SMACKS_MAX_ACK_DELAY  seconds to wait for a requested ack before hibernating (default 5)
local lab = assert(ENV_PROSODY_LAB, "set PROSODY_LAB to a writable folder")

run_as_root = true            -- the lab runs as root; mod_posix refuses otherwise
pidfile = lab.."/prosody.pid"
data_path = lab.."/data"
certificates = lab.."/certs"  -- empty folder: no TLS in the lab
plugin_paths = { "/usr/lib/prosody/modules" }  -- Debian prosody-modules installs here

-- network: loopback only, no s2s, no http
interfaces = { "127.0.0.1" }
c2s_ports = { tonumber(ENV_C2S_PORT or "5222") }
c2s_interfaces = { "127.0.0.1" }
component_ports = { tonumber(ENV_COMPONENT_PORT or "5347") }
component_interfaces = { "127.0.0.1" }
modules_disabled = { "s2s", "s2s_auth_certs" }

-- no certificates: allow plaintext c2s and PLAIN/SCRAM without TLS
c2s_require_encryption = false
allow_unencrypted_plain_auth = true
authentication = "internal_hashed"
storage = "internal"

-- XEP-0077 in-band registration, unthrottled so every test can make fresh users
allow_registration = true
min_seconds_between_registrations = 0
registration_throttle_max = 100000

modules_enabled = {
  "roster"; "saslauth"; "disco"; "register";
  "carbons"; "smacks"; "mam"; "ping"; "time"; "version";
  "cloud_notify";
  "stanza_debug";  -- the debug log gets full c2s stanzas (not component streams)
}

-- XEP-0198: short timers so tests never wait long
smacks_hibernation_time = tonumber(ENV_SMACKS_HIBERNATION or "60")
smacks_max_ack_delay = tonumber(ENV_SMACKS_MAX_ACK_DELAY or "5")

-- XEP-0357 (mod_cloud_notify)
push_max_errors = tonumber(ENV_PUSH_MAX_ERRORS or "16")
push_notification_with_body = ENV_PUSH_WITH_BODY == "1"
push_notification_with_sender = ENV_PUSH_WITH_SENDER == "1"

log = {
  { levels = { min = "debug" }, to = "file", filename = lab.."/prosody.log" };
  { levels = { min = "info" }, to = "console" };
}

VirtualHost "localhost"

-- XEP-0114 components; keep this section last: options set after a Component line belong to it.
for i = 1, tonumber(ENV_COMPONENT_COUNT or "1") do
  local jid = os.getenv("COMPONENT_"..i.."_JID") or (i == 1 and "push.localhost")
  local secret = os.getenv("COMPONENT_"..i.."_SECRET") or (i == 1 and "s3cr3t")
  assert(jid and secret, "set COMPONENT_"..i.."_JID and COMPONENT_"..i.."_SECRET")
  Component(jid)
    component_secret = secret
end
