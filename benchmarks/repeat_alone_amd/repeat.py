"""Send each prompt alone N times to a running server (greedy, one request at a time) and
count the answers equal to its first.

    python benchmarks/repeat_alone_amd/repeat.py URL N QUESTIONS.jsonl PROMPTS MODEL
"""

import json
import sys

import httpx


def main() -> None:
    url, n, questions, count, model = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    with open(questions) as lines:
        prompts = [json.loads(line)["turns"][0] for line in lines][:count]
    same = total = 0
    with httpx.Client(base_url=url, timeout=600) as client:
        for prompt in prompts:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 128}
            texts = []
            for _ in range(n):
                answer = client.post("/v1/chat/completions", json={**body, "temperature": 0})
                answer.raise_for_status()
                texts.append(answer.json()["choices"][0]["message"]["content"])
            matches = sum(text == texts[0] for text in texts[1:])
            same, total = same + matches, total + n - 1
            print(f"{matches}/{n - 1}", flush=True)
    print(f"same as the first: {same} of {total}")


if __name__ == "__main__":
    main()
