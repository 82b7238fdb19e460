"""gRPC server reflection, as the reference servicer serves it (``grpcurl -plaintext HOST:PORT list``).

The reference registers grpcio's reflection with three names: the engine
contract's service, ``grpc.health.v1.Health`` and
``grpc.reflection.v1alpha.ServerReflection``. grpclib ships the same protocol
(``grpclib.reflection.service.ServerReflection``, v1 and v1alpha); its
``extend`` lists the services it is given, not itself, so it is asked twice:
the first answer's v1alpha service is there only to be named by the second.
Descriptors come from protobuf's default pool, where the contract's and
health's ``_pb2`` modules registered their files when imported (``grpcurl
describe`` works too). Reflection calls are ordinary grpclib calls: the fast
path (``fastpath.py``) writes only the engine contract's streams.
"""

from __future__ import annotations

from grpclib.reflection.service import ServerReflection

V1ALPHA_NAME = "grpc.reflection.v1alpha.ServerReflection"


def with_reflection(services: list) -> list:
    """``services`` and the reflection services that list them and v1alpha reflection, as the reference does."""
    first = ServerReflection.extend(services)
    [v1alpha] = [service for service in first[len(services):] if _name(service) == V1ALPHA_NAME]
    # [*services, the first v1alpha (named, not served), v1, v1alpha]
    named = ServerReflection.extend([*services, v1alpha])
    return [*services, *named[len(services) + 1:]]


def _name(service) -> str:
    return next(iter(service.__mapping__())).split("/")[1]
