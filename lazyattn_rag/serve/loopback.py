"""Keep a Serve replica's own gRPC server on loopback in a private cluster (issue 37).

In a cluster started by :func:`~lazyattn_rag.serve.app.start_ray` every Ray process binds the node
address, 127.0.0.1, except one: Ray Serve (2.60) starts each replica's inter-deployment gRPC
server on ``[::]:0``, every interface, whatever the node address. :func:`bind_replica_server_to_loopback`
is called by each of our replicas in its constructor, before Serve starts that server: on a node
whose address is loopback, it makes the server bind 127.0.0.1 too (handles reach replicas at the
node address, so nothing else changes). On a node with an outward address (a multi-node cluster,
``--ray-address``) it does nothing. ``tests/test_serve_security.py`` lists the sockets to check.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("lazyattn_rag.serve")


def bind_replica_server_to_loopback() -> bool:
    """Rebind this replica's inter-deployment gRPC server to 127.0.0.1 when the node's address
    is loopback; whether it did (``False`` off loopback, outside Serve, or on a Ray whose replica
    module has changed: then logged)."""
    try:
        import ray
        from ray.serve._private import replica as serve_replica

        from lazyattn_rag.serve.auth import is_loopback

        if not ray.is_initialized() or not is_loopback(ray.util.get_node_ip_address()):
            return False
    except ImportError:
        return False
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None:
        logger.warning("this Ray Serve has no replica.add_port_to_grpc_server: its replicas' gRPC servers may "
                       "listen beyond loopback")
        return False
    if getattr(original, "binds_loopback", False):
        return True

    def add_port(server, address: str):
        host, _, port = address.rpartition(":")
        if host in ("[::]", "0.0.0.0", "", "::"):
            address = f"127.0.0.1:{port}"
        return original(server, address)

    add_port.binds_loopback = True
    serve_replica.add_port_to_grpc_server = add_port
    return True
