from __future__ import annotations

import errno

import pytest

from cachefs.base.config import EngineConfig, load_config, parse_size
from cachefs.base.errors import (
    AccessDeniedError,
    ConfigError,
    CredentialsError,
    InvalidURLError,
    ObjectNotFoundError,
    OriginUnavailableError,
    StaleObjectError,
    ThrottledError,
    TransientOriginError,
    translate_origin_error,
)
from cachefs.base.types import canonical_url, dataset_id


def test_layers_defaults_yaml_env_flags(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("cache:\n  dir: /from/yaml\n  block_size: 1MiB\nengine:\n  memory_budget: 64MiB\n")
    cfg = load_config(cfg_file, env={"CACHEFS_ENGINE_MEMORY_BUDGET": "128MiB"}, overrides={"cache_dir": "/from/flag"})
    assert cfg.cache.dir == "/from/flag"
    assert cfg.cache.block_size == 1024 * 1024
    assert cfg.engine.memory_budget == 128 * 1024 * 1024
    assert cfg.engine.max_concurrent_fetches == EngineConfig().max_concurrent_fetches  # default


@pytest.mark.parametrize(("env", "words"), [
    ({"CACHEFS_CACHE_BLOCK_SIZE": "3000"}, "power of two"),
    ({"CACHEFS_CACHE_HIGH_WATERMARK": "0.5", "CACHEFS_CACHE_LOW_WATERMARK": "0.9"}, "watermark"),
    ({"CACHEFS_ENGINE_MEMORY_BUDGET": "lots"}, "cannot read"),
    ({"CACHEFS_CACHE_CAPACITY": "120%"}, "percentage"),
    ({"CACHEFS_ORIGIN_MAX_ATTEMPTS": "0"}, "max_attempts"),
    ({"CACHEFS_ORIGIN_ACCESS_KEY_ID": "AKIA"}, "together"),
])
def test_invalid_config_is_a_clear_error(env, words):
    with pytest.raises(ConfigError, match=words):
        load_config(env=env)


def test_unknown_yaml_key_and_override(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  nope: 1\n")
    with pytest.raises(ConfigError, match=r"cache\.nope"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="unknown option"):
        load_config(env={}, overrides={"bogus": 1})


def test_secrets_are_not_in_repr():
    cfg = load_config(env={"CACHEFS_ORIGIN_ACCESS_KEY_ID": "AKIAXXX", "CACHEFS_ORIGIN_SECRET_ACCESS_KEY": "s3cr3t"})
    assert "s3cr3t" not in repr(cfg) and "AKIAXXX" not in repr(cfg)


def test_parse_size():
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("10 GB") == 10 * 10**9
    assert parse_size(123) == 123
    with pytest.raises(ConfigError):
        parse_size("-1")


@pytest.mark.parametrize(("url", "canon"), [
    ("s3://bucket/prefix/", "s3://bucket/prefix"),
    ("s3a://bucket/p", "s3://bucket/p"),
    ("/data/set/", "file:///data/set"),
    ("file:///data//set/./x", "file:///data/set/x"),
    ("gs://b", "gs://b"),
])
def test_canonical_url(url, canon):
    assert canonical_url(url) == canon


@pytest.mark.parametrize("url", ["", "relative/path", "s3://", "s3://b/a/../c", "file://rel", "s3://b/k?x=1",
                                 "cachefs::s3://b/k"])
def test_bad_urls(url):
    with pytest.raises(InvalidURLError):
        canonical_url(url)


def test_dataset_id_is_short_stable_and_label_safe():
    a = dataset_id("s3://bucket/prefix")
    assert a == dataset_id("s3://bucket/prefix/") and len(a) == 16 and a.isalnum() and a == a.lower()
    assert a != dataset_id("s3://bucket/prefix2")


def _client_error(code, status):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize(("code", "status", "cls", "err"), [
    ("NoSuchKey", 404, ObjectNotFoundError, errno.ENOENT),
    ("AccessDenied", 403, AccessDeniedError, errno.EACCES),
    ("InvalidAccessKeyId", 403, CredentialsError, errno.EACCES),
    ("PreconditionFailed", 412, StaleObjectError, errno.ESTALE),
    ("SlowDown", 503, ThrottledError, errno.EAGAIN),
    ("InternalError", 500, TransientOriginError, errno.EIO),
    ("WeirdNewCode", 599, TransientOriginError, errno.EIO),
])
def test_origin_error_table(code, status, cls, err):
    got = translate_origin_error(_client_error(code, status), "s3://b/k")
    assert type(got) is cls and got.errno == err and isinstance(got, OSError)
    assert "s3://b/k" in str(got)


def test_connection_and_timeout_translation():
    class EndpointConnectionError(Exception):
        pass

    assert isinstance(translate_origin_error(EndpointConnectionError(), "x"), OriginUnavailableError)
    assert isinstance(translate_origin_error(TimeoutError(), "x"), TransientOriginError)
    assert translate_origin_error(TimeoutError(), "x").retryable
    assert not translate_origin_error(_client_error("AccessDenied", 403), "x").retryable
