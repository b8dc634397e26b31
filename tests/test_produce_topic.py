"""`streamer produce` onto a topic that exists: its partition count, the records it already holds
(refused, resumed or appended to), and --loop's open-ended manifest. Through the embedded broker."""

import asyncio
import json

from producers.kafka import ensure_topic
from streamer.cli import main


def produce_args(broker, corpus, topic, manifest, *extra) -> list[str]:
    return ["produce", "--corpus", str(corpus), "--bootstrap-servers", broker.bootstrap_servers, "--topic", topic,
            "--fragments", "4", "--lambda", "600", "--streams", "3", "--window", "10", "--probe-tokens", "0",
            "--manifest", str(manifest), *extra]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_topic_with_another_partition_count_is_refused_before_anything_is_written(broker, tiny_corpus, tmp_path,
                                                                                   capsys):
    for existing, asked, topic in ((3, 2, "parts-fewer"), (1, 3, "parts-more")):
        asyncio.run(ensure_topic(broker.bootstrap_servers, topic, partitions=existing))
        manifest = tmp_path / f"{topic}.json"
        assert main(produce_args(broker, tiny_corpus, topic, manifest, "--partitions", str(asked))) == 2
        line = one_error_line(capsys)
        assert f"topic {topic} exists with {existing} partition" in line and f"--partitions is {asked}" in line
        assert not manifest.exists()
