"""The JSON examples of the UWPX push server's README (docs/protocols.md 3), copied verbatim.

The project never reads /work/shared at runtime, so the tests keep their own copy.
"""

SEED_SET_CHANNEL_URI = """{
	"version": 1,
	"action": "set_channel_uri",
	"device_id": "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b",
	"channel_uri": "ms-app://s-1-15-2-3598129719-3378870262-4208132049-182512184-2493220926-1891298429-4035237700"
}"""
SEED_SUCCESS = """{
	"version": 1,
	"action": "response",
	"status": 1
}"""
SEED_ERROR = """{
	"version": 1,
	"action": "response",
	"status": 0,
	"error": "Some error message e.g. Invalid JSON format."
}"""
SEED_SET_ACCOUNTS = """{
	"version": 1,
	"action": "set_accounts",
	"device_id": "5486bd868050a620141f4e81c9f1d2c67ab0de27e5e26d218ca41c9394ee806b",
	"accounts": [
		{
			"bare_jid": "someClient@xmpp.uwpx.org"
		},
		{
			"bare_jid": "someOtherClient@xmpp.uwpx.org"
		}
	]
}"""
# Not valid JSON as published (trailing commas): only its shape is compared.
SEED_SET_ACCOUNTS_SUCCESS = """{
	"version": 1,
	"action": "response",
	"status": 1,
	"push_bare_jid": "push@xmpp.uwpx.org",
	"accounts": [
		{
			"bare_jid": "someClient@xmpp.uwpx.org",
			"node": "773bds9nf932",
			"secret": "sdf/82h)=1",
		},
		{
			"bare_jid": "someOtherClient@xmpp.uwpx.org",
			"node": "8w3rn0MB3m38z2",
			"secret": "j$o909mN87!n/0m",
		}
	]
}"""
