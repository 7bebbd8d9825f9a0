"""GET /v1/responses/ID/input_items (OpenAI's input item list) through the openai client and raw
HTTP, on the tiny model: a response's items are the conversation that made it (the inputs of
the responses before it through previous_response_id, their outputs, then its own input; not
its instructions, nor its own output) as message items, newest first unless `order` is asc;
`limit` and `after` page through them with ids that stay the same from call to call; an id not
stored is the 404 that GET /v1/responses/ID gives, and a bad limit, order, after or include is
a 400 naming it; the route takes GET (and HEAD) only; the store keeps where each response's
input ends."""

from __future__ import annotations

import pytest

from statechat.api_responses_store import ResponseStore
from tests.server.test_responses import call

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")


@pytest.fixture(scope="module")
def chain(client) -> tuple:
    """A two-turn chain: (first response, second response continuing it)."""
    first = client.responses.create(model="m", input=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        instructions="Be kind.", max_output_tokens=4, temperature=0)
    second = client.responses.create(model="m", input="And then?", instructions="Be kind.",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     temperature=0)
    return first, second


def shown(item) -> tuple:
    return item.type, item.role, [(part.type, part.text) for part in item.content], item.status


def test_the_items_are_the_conversation_before_the_output(client, chain):
    first, second = chain
    page = client.responses.input_items.list(second.id, order="asc")
    assert page.object == "list" and page.has_more is False
    assert [shown(item) for item in page.data] == [
        ("message", "system", [("input_text", "Be brief.")], "completed"),
        ("message", "user", [("input_text", "Hi")], "completed"),
        ("message", "assistant", [("output_text", first.output_text)], "completed"),
        ("message", "user", [("input_text", "And then?")], "completed")]
    assert page.data[2].content[0].annotations == []
    assert page.first_id == page.data[0].id and page.last_id == page.data[-1].id
    assert len({item.id for item in page.data}) == 4
    own = client.responses.input_items.list(first.id, order="asc")
    assert [shown(item) for item in own.data] == [shown(item) for item in page.data[:2]]


def test_the_newest_come_first_unless_asked_and_ids_stay(client, chain):
    rid = chain[1].id
    ascending = client.responses.input_items.list(rid, order="asc").data
    newest_first = client.responses.input_items.list(rid).data  # (OpenAI's default: desc)
    assert [i.id for i in newest_first] == [i.id for i in reversed(ascending)]
    assert client.responses.input_items.list(rid, order="desc").data == newest_first


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_limit_and_after_page_through_the_items(client, chain, order):
    rid = chain[1].id
    whole = client.responses.input_items.list(rid, order=order).data
    page = client.responses.input_items.list(rid, order=order, limit=3)
    assert [i.id for i in page.data] == [i.id for i in whole[:3]] and page.has_more is True
    rest = client.responses.input_items.list(rid, order=order, limit=3, after=page.last_id)
    assert [i.id for i in rest.data] == [whole[3].id] and rest.has_more is False
    paged = client.responses.input_items.list(rid, order=order, limit=1)
    assert [i.id for i in paged] == [i.id for i in whole]  # (the client follows `after`)
    last = client.responses.input_items.list(rid, order=order, after=whole[-1].id)
    assert last.data == [] and last.has_more is False


def test_an_unknown_response_is_a_404_as_get_gives(client, server):
    status, answer, _ = call(server, "GET", "/v1/responses/resp_none/input_items")
    assert status == 404 and answer == call(server, "GET", "/v1/responses/resp_none")[1]
    assert answer["error"]["code"] == "response_not_found"
    unstored = client.responses.create(model="m", input="Forget me", max_output_tokens=2,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(unstored.id)


@pytest.mark.parametrize(("query", "param"), [
    ("limit=0", "limit"), ("limit=101", "limit"), ("limit=ten", "limit"), ("limit=%C2%B2", "limit"),
    ("order=up", "order"), ("after=msg_none", "after"),
    ("include[]=message.output_text.logprobs", "include"), ("include=nope", "include"),
])
def test_bad_query_parameters_are_400s_naming_them(server, chain, query, param):
    status, answer, _ = call(server, "GET", f"/v1/responses/{chain[1].id}/input_items?{query}")
    error = answer["error"]
    assert status == 400 and error["param"] == param and "\n" not in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_include_values_that_change_nothing_are_taken(client, chain):
    page = client.responses.input_items.list(chain[1].id, include=[
        "reasoning.encrypted_content", "message.input_image.image_url"], limit=100)
    assert len(page.data) == 4


def test_other_methods_are_405s(server, chain):
    status, answer, headers = call(server, "DELETE", f"/v1/responses/{chain[1].id}/input_items")
    assert status == 405 and headers["Allow"] == "GET, HEAD", answer
    assert "GET (or HEAD) /v1/models" in answer["error"]["message"]
    assert "/v1/responses/ID/input_items" in answer["error"]["message"]


def test_the_store_keeps_where_a_response_s_input_ends():
    store = ResponseStore()
    said = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    store.put({"id": "r"}, [*said, {"role": "assistant", "content": "d"}], 4, num_input=3)
    assert store.input_of("r") == said and store.input_of("x") is None
