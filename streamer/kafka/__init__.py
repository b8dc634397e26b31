"""The Kafka side of the learner (KafkaSource and the rooms it uses): in streamer/, the one package importing aiokafka."""

__all__ = ["assignment", "commits", "consumer", "dead_letters", "lag", "learner_group", "reach"]
