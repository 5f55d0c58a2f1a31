from django.apps import AppConfig


class XmppGatewayConfig(AppConfig):
    name = "xmppgateway"
    verbose_name = "XMPP gateway"
