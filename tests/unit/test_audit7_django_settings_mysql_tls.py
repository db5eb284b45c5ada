"""TLS and option files of a MySQL URL (``ssl_ca``, ``ssl_cert``, ``ssl_key``, ``ssl_mode``,
``read_default_file``), and the URL outboxer derives from a Django MySQL entry's ``OPTIONS``
(``ssl``, ``ssl_mode``, ``read_default_file``), which used to drop them: the relay and the
consumer connected without the TLS the project configured. No TLS server: the mapping to the
drivers' ``ssl`` argument is what is checked.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import ssl
import subprocess
import sys
import textwrap
from urllib.parse import quote

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from outboxer.errors import ConfigError
from outboxer.stores.mysql import mysql_connect_args

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed certificate (the CA and the client certificate at once) and its key."""
    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "outboxer-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    paths = {"cert": folder / "cert.pem", "key": folder / "key.pem", "junk": folder / "junk.pem"}
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    paths["junk"].write_text("not a certificate\n")
    return {name: str(path) for name, path in paths.items()}


def url(**query: str) -> str:
    options = "&".join(f"{name}={quote(value, safe='')}" for name, value in query.items())
    return f"mysql://app@db.example:3307/orders?{options}"


def context(**query: str) -> ssl.SSLContext:
    made = mysql_connect_args(url(**query))["ssl"]
    assert isinstance(made, ssl.SSLContext)
    return made


def test_a_ca_verifies_the_server_s_certificate_and_name(pems: dict[str, str]) -> None:
    made = context(ssl_ca=pems["cert"])
    assert (made.verify_mode, made.check_hostname) == (ssl.CERT_REQUIRED, True)
    assert [cert["subject"] for cert in made.get_ca_certs()] == [
        ((("commonName", "outboxer-test"),),)
    ]


def test_the_modes_choose_what_is_verified(pems: dict[str, str]) -> None:
    made = context(ssl_ca=pems["cert"], ssl_mode="VERIFY_CA")
    assert (made.verify_mode, made.check_hostname) == (ssl.CERT_REQUIRED, False)
    made = context(ssl_mode="required", ssl_cert=pems["cert"], ssl_key=pems["key"])
    assert (made.verify_mode, made.check_hostname) == (ssl.CERT_NONE, False)
    made = context(ssl_cert=pems["cert"], ssl_key=pems["key"])  # a client certificate only
    assert made.verify_mode == ssl.CERT_NONE
    assert "ssl" not in mysql_connect_args(url(ssl_mode="disabled"))


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ({"ssl_mode": "sometimes"}, "ssl_mode='sometimes'; known"),
        ({"ssl_ca": "/nonexistent/ca.pem"}, "ssl_ca: cannot load '/nonexistent/ca.pem'"),
        ({"ssl_ca": "JUNK"}, "ssl_ca: cannot load"),
        ({"ssl_cert": "CERT", "ssl_key": "JUNK"}, "ssl_cert/ssl_key: cannot load"),
        ({"ssl_key": "KEY"}, "ssl_key needs ssl_cert"),
        ({"ssl_ca": "CERT", "ssl_mode": "required"}, "the CA would not be checked"),
        ({"ssl_ca": "CERT", "ssl_mode": "disabled"}, "contradicts"),
    ],
)
def test_bad_tls_options_are_config_errors(
    pems: dict[str, str], query: dict[str, str], message: str
) -> None:
    files = {"JUNK": pems["junk"], "CERT": pems["cert"], "KEY": pems["key"]}
    given = {name: files.get(value, value) for name, value in query.items()}
    with pytest.raises(ConfigError, match=re.escape(message)):
        mysql_connect_args(url(**given))


def test_an_option_file_gives_what_the_url_leaves_out() -> None:
    args = mysql_connect_args("mysql://app@/orders?read_default_file=/etc/app.cnf")
    # No host, port or password: the drivers take the file's (an argument would win).
    assert args == {
        "user": "app",
        "database": "orders",
        "charset": "utf8mb4",
        "read_default_file": "/etc/app.cnf",
    }
    args = mysql_connect_args("mysql://app:pw@db:3307/orders?read_default_group=outboxer")
    assert (args["host"], args["port"], args["password"]) == ("db", 3307, "pw")
    assert args["read_default_group"] == "outboxer"


DERIVE = """
    import json, ssl
    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {{name: getattr(project, name) for name in dir(project) if name.isupper()}}
    entry = {{"ENGINE": "django.db.backends.mysql", "NAME": "orders", "USER": "app",
             "HOST": "db.example", "PORT": "3307"}}
    options = {options}
    options["context"] = {{"ssl": ssl.create_default_context()}}
    values["DATABASES"] = {{
        "default": {{**entry, "OPTIONS": {{}}}},
        **{{alias: {{**entry, "OPTIONS": given}} for alias, given in options.items()}},
    }}
    settings.configure(**values)
    django.setup()
    from outboxer.contrib.django import conf
    from outboxer.errors import ConfigError

    urls = {{}}
    for alias in options:
        try:
            urls[alias] = conf.database_url(alias)
        except ConfigError as exc:
            urls[alias] = f"ConfigError: {{exc}}"
    print(json.dumps(urls))
"""


def derive(options: dict[str, object]) -> dict[str, str]:
    """The URL outboxer derives for each alias, whose OPTIONS are ``options[alias]``."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OUTBOXER_TEST_DJANGO_DB="sqlite:///unused.db")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DERIVE.format(options=repr(options)))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    urls: dict[str, str] = json.loads(result.stdout)
    return urls


def test_django_mysql_options_reach_the_url_outboxer_connects_with(pems: dict[str, str]) -> None:
    urls = derive(
        {
            "tls": {"ssl": {"ca": pems["cert"], "cert": pems["cert"], "key": pems["key"]}},
            "no_name_check": {"ssl": {"ca": pems["cert"], "check_hostname": False}},
            "unverified": {"ssl": {"ca": pems["cert"], "verify_mode": "none"}},
            "mode": {"ssl_mode": "VERIFY_IDENTITY", "ssl": {"ca": pems["cert"]}},
            "cnf": {"read_default_file": "/etc/app.cnf", "connect_timeout": 5},
            "capath": {"ssl": {"capath": "/etc/ssl/certs"}},
        }
    )
    made = mysql_connect_args(urls["tls"])["ssl"]
    assert (made.verify_mode, made.check_hostname) == (ssl.CERT_REQUIRED, True)
    assert len(made.get_ca_certs()) == 1
    assert not mysql_connect_args(urls["no_name_check"])["ssl"].check_hostname
    assert mysql_connect_args(urls["unverified"])["ssl"].verify_mode == ssl.CERT_NONE
    assert mysql_connect_args(urls["mode"])["ssl"].check_hostname
    args = mysql_connect_args(urls["cnf"])
    assert (args["read_default_file"], args["connect_timeout"]) == ("/etc/app.cnf", 5.0)
    # What the URL cannot carry is refused, not dropped: the relay would connect without it.
    assert urls["capath"].startswith("ConfigError: database 'capath': OPTIONS[\"ssl\"]")
    assert "['capath']" in urls["capath"]
    assert urls["context"].startswith("ConfigError: database 'context'")
    assert "SSLContext" in urls["context"]
