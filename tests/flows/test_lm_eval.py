"""lm-evaluation-harness against the server: its ``local-chat-completions`` model on a local task of
arithmetic test problems (a JSON file, no Hub), graded by semspec's grader. Every response it logs, and so
its score, equals what the API decodes for the same problems with the same settings (greedy, the same
budget and stop string), the decode ``semspec evaluate`` runs."""

from __future__ import annotations

import json
import textwrap

from semspec.models.spec.grading import grade
from semspec.stops import StopStrings
from semspec.tasks.data import generate_arith
from tests.helpers.serving import TinySpec, running_server

N, BUDGET, STOP = 4, 24, "Question:"
LM_EVAL_SEED = 1234  # the seed local-chat-completions sends with every request

UTILS = """
from semspec.models.spec.grading import grade


def process_results(doc, results):
    return {"correct": float(grade("arith", doc["answer"], results[0])[1])}
"""


def _task(folder, data) -> None:
    (folder / "utils.py").write_text(textwrap.dedent(UTILS))
    (folder / "arith_local.yaml").write_text(
        textwrap.dedent(
            f"""
            task: arith_local
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
            test_split: test
            output_type: generate_until
            doc_to_text: "{{{{question}}}}"
            doc_to_target: "{{{{answer}}}}"
            generation_kwargs:
              until: ["{STOP}"]
              max_gen_toks: {BUDGET}
              temperature: 0.0
              do_sample: false
            process_results: !function utils.process_results
            metric_list:
              - metric: correct
                aggregation: mean
                higher_is_better: true
            """
        )
    )


def test_lm_eval_through_the_server_scores_what_the_api_decodes(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    problems = generate_arith(N, "test", seed=0)
    data = tmp_path / "arith.jsonl"
    data.write_text(
        "".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n" for p in problems)
    )
    _task(tmp_path, data)
    llm = TinySpec()
    with running_server(llm, max_tokens_limit=64, spec_max_batch=None) as (base, _):
        out = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args=f"model=tiny,base_url={base}/v1/chat/completions,num_concurrent=1,max_retries=1,"
            "tokenized_requests=False",
            tasks=["arith_local"],
            task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
            apply_chat_template=True,
            log_samples=True,
        )
    samples = {s["doc"]["question"]: s["resps"][0][0] for s in out["samples"]["arith_local"]}
    expected, correct = {}, []
    for p in problems:  # the API's decode of each problem, cut at the stop string as the server cuts it
        chat = [{"role": "user", "content": p.question}]
        res = llm.generate(chat, max_new_tokens=BUDGET, temperature=0.0, seed=LM_EVAL_SEED)
        stops = StopStrings([STOP])
        for step in res.steps:
            stops.feed(step.text)
        text = res.text[: stops.released] if stops.stopped else res.text
        expected[p.question] = text
        correct.append(grade("arith", p.answer, text)[1])
    assert samples == expected
    assert out["results"]["arith_local"]["correct,none"] == sum(correct) / N
