"""Message types for the proto tests, built from descriptors (no protoc needed).

``TrainConfig`` is added to protobuf's default pool, as importing a generated
``_pb2`` module would do. ``Secret`` lives in a private pool, so it stands
for a message type the loading program has never imported.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
PACKAGE = "checkpointables_test"


def _field(message, name, number, type_, label=_F.LABEL_OPTIONAL, type_name=None):
    field = message.field.add(name=name, number=number, type=type_, label=label)
    if type_name is not None:
        field.type_name = type_name
    return field


def _train_config_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="checkpointables_test/train_config.proto", package=PACKAGE, syntax="proto3"
    )
    optimizer = file.enum_type.add(name="Optimizer")
    for number, name in enumerate(["OPTIMIZER_UNSPECIFIED", "SGD", "ADAM"]):
        optimizer.value.add(name=name, number=number)
    schedule = file.message_type.add(name="Schedule")
    _field(schedule, "warmup_steps", 1, _F.TYPE_INT64)
    _field(schedule, "decay", 2, _F.TYPE_FLOAT)
    config = file.message_type.add(name="TrainConfig")
    entry = config.nested_type.add(name="WeightsEntry")
    entry.options.map_entry = True
    _field(entry, "key", 1, _F.TYPE_STRING)
    _field(entry, "value", 2, _F.TYPE_FLOAT)
    _field(config, "learning_rate", 1, _F.TYPE_DOUBLE)
    _field(config, "name", 2, _F.TYPE_STRING)
    _field(config, "layers", 3, _F.TYPE_INT32, _F.LABEL_REPEATED)
    _field(config, "optimizer", 4, _F.TYPE_ENUM, type_name=f".{PACKAGE}.Optimizer")
    _field(
        config,
        "weights",
        5,
        _F.TYPE_MESSAGE,
        _F.LABEL_REPEATED,
        type_name=f".{PACKAGE}.TrainConfig.WeightsEntry",
    )
    _field(config, "blob", 6, _F.TYPE_BYTES)
    _field(config, "schedule", 7, _F.TYPE_MESSAGE, type_name=f".{PACKAGE}.Schedule")
    return file


def _secret_file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(
        name="checkpointables_test/secret.proto", package=f"{PACKAGE}.private", syntax="proto3"
    )
    secret = file.message_type.add(name="Secret")
    _field(secret, "code", 1, _F.TYPE_STRING)
    return file


def _default_pool_class(full_name: str, file: descriptor_pb2.FileDescriptorProto) -> type:
    pool = descriptor_pool.Default()
    try:
        descriptor = pool.FindMessageTypeByName(full_name)
    except KeyError:  # First import of this module in the process.
        pool.AddSerializedFile(file.SerializeToString())
        descriptor = pool.FindMessageTypeByName(full_name)
    return message_factory.GetMessageClass(descriptor)


TrainConfig = _default_pool_class(f"{PACKAGE}.TrainConfig", _train_config_file())

_private_pool = descriptor_pool.DescriptorPool()
_private_pool.AddSerializedFile(_secret_file().SerializeToString())
Secret = message_factory.GetMessageClass(
    _private_pool.FindMessageTypeByName(f"{PACKAGE}.private.Secret")
)


def train_config() -> object:
    """A TrainConfig with every kind of field set."""
    config = TrainConfig(
        learning_rate=0.1,
        name="run-ü-7",
        layers=[512, 256, -1],
        optimizer=2,
        blob=b"\x00\xffbytes",
    )
    config.weights["a"] = 0.5
    config.weights["b"] = -3.25
    config.schedule.warmup_steps = 2**40
    config.schedule.decay = 0.999
    return config
