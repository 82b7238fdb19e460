"""The media SSRF policy, sans-io: address classes, literal forms, schemes, redirects."""

from __future__ import annotations

import socket

import pytest

from enginelink.machines.media_policy import (
    MediaPolicy, MediaRefused, _inet_aton, check_url, classify_address, redirect_target,
)  # fmt: skip

POLICY = MediaPolicy()


@pytest.mark.parametrize("address,reason", [
    ("8.8.8.8", None), ("93.184.216.34", None), ("2606:4700::1111", None),
    ("127.0.0.1", "loopback"), ("127.255.0.9", "loopback"), ("::1", "loopback"),
    ("169.254.169.254", "link_local"), ("fe80::1", "link_local"), ("fe80::1%2", "link_local"),
    ("10.0.0.1", "private"), ("172.31.255.255", "private"), ("192.168.0.1", "private"),
    ("100.64.0.1", "shared_address_space"), ("198.19.0.1", "benchmarking"), ("255.255.255.255", "broadcast"),
    ("224.0.0.251", "multicast"), ("ff02::1", "multicast"), ("0.0.0.0", "unspecified"), ("::", "unspecified"),
    ("fd12::1", "unique_local"), ("64:ff9b:1::1", "nat64_local_use"), ("240.0.0.1", "non_public"),
    ("192.0.2.1", "private"), ("2001:db8::1", "private"),
    # IPv6 forms that carry an IPv4 address: judged by it.
    ("::ffff:10.0.0.1", "private"), ("::ffff:8.8.8.8", None), ("64:ff9b::a9fe:a9fe", "link_local"),
    ("2002:c0a8:0101::", "private"), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "private"),  # Teredo, client 192.0.2.45
])  # fmt: skip
def test_address_classes(address, reason):
    assert classify_address(address) == reason


@pytest.mark.parametrize("host", ["2130706433", "0x7f000001", "0177.0.0.1", "127.1", "0", "10.1", "0xff.0xffffff",
                                  "1.2.65535", "1.2.65536", "4294967296", "256.1", "08", "0x", "cdn.example", "1e3"])
def test_integer_and_short_forms_parse_as_inet_aton_does(host):
    try:
        expected = socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        expected = None
    assert _inet_aton(host) == expected


def test_schemes_and_the_file_folder():
    assert check_url("https://cdn.example/a.png", POLICY).host == "cdn.example"
    assert check_url("data:image/png;base64,AA==", POLICY).scheme == "data"
    for url, reason in [("file:///a.png", "scheme"), ("ftp://cdn.example/a", "scheme"), ("", "bad_url"),
                        ("http:///a.png", "bad_url"), ("http://cdn.example:99999/", "bad_url"),
                        ("javascript:alert(1)", "scheme")]:
        with pytest.raises(MediaRefused) as error:
            check_url(url, POLICY)
        assert error.value.reason == reason, url
    assert check_url("file:///srv/media/a.png", MediaPolicy(allowed_local_path="/srv/media")).scheme == "file"
    assert MediaPolicy(allowed_local_path="/srv/media").schemes == ("http", "https", "data", "file")


def test_allow_private_turns_off_the_address_checks_only():
    allow = MediaPolicy(allow_private=True)
    assert check_url("http://127.0.0.1:8/a", allow).host == "127.0.0.1"
    assert check_url("http://localhost/a", allow).host == "localhost"
    with pytest.raises(MediaRefused):
        check_url("gopher://127.0.0.1/a", allow)
    with pytest.raises(MediaRefused):
        redirect_target("http://127.0.0.1/a", "file:///etc/passwd", 1, allow)


def test_redirects_resolve_relative_locations_and_keep_the_budget():
    assert redirect_target("https://cdn.example/a/b.png", "../c.png", 1, POLICY).url == "https://cdn.example/c.png"
    assert redirect_target("https://cdn.example/a", "//other.example/x", 1, POLICY).host == "other.example"
    with pytest.raises(MediaRefused, match="more than 5 redirects"):
        redirect_target("https://cdn.example/a", "/b", 6, POLICY)
    with pytest.raises(MediaRefused, match="without a Location"):
        redirect_target("https://cdn.example/a", "", 1, POLICY)
    with pytest.raises(MediaRefused, match="redirected to 'http://10.0.0.1/x'"):
        redirect_target("https://cdn.example/a", "http://10.0.0.1/x", 1, POLICY)


# -- --allowed-media-domains: vLLM's MediaConnector semantics (exact host), at every hop ----------------------

DOMAINS = MediaPolicy(allowed_domains=("example.com", "images.example.org", "93.184.216.34", "2606:4700::1111"))


@pytest.mark.parametrize("url", [
    "https://example.com/cat.png", "http://EXAMPLE.com:8080/cat.png", "https://example.com./cat.png",
    "https://images.example.org/a.png", "http://93.184.216.34/x.png", "http://[2606:4700::1111]/x.png",
    "data:image/png;base64,AAAA",  # not fetched from a host: not a domain's business (vLLM's neither)
])  # fmt: skip
def test_an_allowed_host_passes(url):
    assert check_url(url, DOMAINS).url == url


@pytest.mark.parametrize("url,host", [
    ("https://cdn.example.com/cat.png", "cdn.example.com"),  # no subdomains, as vLLM
    ("https://example.org/cat.png", "example.org"),  # the parent of an allowed name
    ("https://example.com.evil.test/cat.png", "example.com.evil.test"),
    ("https://evilexample.com/cat.png", "evilexample.com"),
    ("https://user:pw@evil.test/example.com", "evil.test"),  # the host, not the text
    ("http://93.184.216.35/x.png", "93.184.216.35"),
])  # fmt: skip
def test_a_host_outside_the_list_is_refused_naming_it(url, host):
    with pytest.raises(MediaRefused) as refused:
        check_url(url, DOMAINS)
    assert refused.value.reason == "domain"
    assert repr(host) in str(refused.value) and "--allowed-media-domains" in str(refused.value)


def test_every_redirect_is_held_to_the_list():
    assert redirect_target("https://example.com/a", "/b", 1, DOMAINS).url == "https://example.com/b"
    assert redirect_target("https://example.com/a", "https://images.example.org/b", 1, DOMAINS).host == \
        "images.example.org"
    with pytest.raises(MediaRefused) as refused:
        redirect_target("https://example.com/a", "https://cdn.example.com/b", 1, DOMAINS)
    assert refused.value.reason == "domain" and "redirected to" in str(refused.value)


def test_an_allowed_host_still_passes_the_address_checks():
    policy = MediaPolicy(allowed_domains=("localhost", "127.0.0.1"))
    for url in ("http://localhost/x.png", "http://127.0.0.1/x.png"):
        with pytest.raises(MediaRefused) as refused:
            check_url(url, policy)
        assert refused.value.reason == "loopback"
    allowing = MediaPolicy(allowed_domains=("127.0.0.1",), allow_private=True)
    assert check_url("http://127.0.0.1/x.png", allowing).host == "127.0.0.1"
    with pytest.raises(MediaRefused, match="not one of the allowed media domains"):
        check_url("http://localhost/x.png", allowing)
