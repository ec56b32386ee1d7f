// Live updates for Chorus Ops admin pages (SPEC §10).  The page names its streams in
// #chorus-live-streams; badges carry data-live-id / data-live-field and are updated in place.
// On reconnect each stream is resumed from the last cursor seen, so nothing is missed.
(function () {
  "use strict";
  var config = document.getElementById("chorus-live-streams");
  var streams = config ? JSON.parse(config.textContent) : [];
  var indicator = document.getElementById("chorus-live-status");
  if (!streams.length) { if (indicator) indicator.remove(); return; }
  var cursors = {};
  var timeline = document.getElementById("chorus-timeline");
  if (timeline) {
    var newest = timeline.querySelector("tr[data-event-id]");
    if (newest) cursors[timeline.dataset.stream] = Number(newest.dataset.eventId);
  }
  var delay = 500;

  function setIndicator(state, text) {
    if (!indicator) return;
    indicator.dataset.state = state;
    indicator.textContent = "live: " + text;
  }

  function label(field, value, data) {
    var text = String(value).replace(/_/g, " ");
    if (field === "status" && value === "interrupted" && data.interrupted_reason) {
      text += " (" + data.interrupted_reason + ")";
    }
    return text;
  }

  function updateBadges(event) {
    var data = event.data || {};
    if (!data.id) return;
    updateRetrying(event, data);
    ["status", "state", "stop_state", "stalled"].forEach(function (field) {
      if (data[field] === undefined) return;
      var nodes = document.querySelectorAll('[data-live-id="' + data.id + '"][data-live-field="' + field + '"]');
      nodes.forEach(function (node) {
        node.textContent = label(field, data[field], data);
        node.className = node.className.replace(/\bchorus-(?!badge\b)[a-z_]+/g, "").trim();
        node.classList.add("chorus-" + data[field], "chorus-flash");
        node.dataset.liveValue = data[field];
        setTimeout(function () { node.classList.remove("chorus-flash"); }, 1500);
      });
    });
  }

  // "retrying: …" beside a turn's status while its CLI retries a model call: set and cleared by
  // the turn.retrying events (sessions_app/bridge._retrying_follow), cleared when it leaves running.
  function updateRetrying(event, data) {
    var text;
    if (event.kind === "turn.retrying") {
      text = String(data.retrying || "");
    } else if (event.kind === "turn.status" && data.status !== "running") {
      text = "";
    } else {
      return;
    }
    document.querySelectorAll('[data-live-id="' + data.id + '"][data-live-field="retrying"]').forEach(function (node) {
      node.textContent = text;
      node.hidden = !text;
    });
  }

  function appendTimeline(event) {
    if (!timeline || timeline.dataset.stream !== event.stream) return;
    if (timeline.querySelector('tr[data-event-id="' + event.id + '"]')) return;
    var body = timeline.tBodies[0];
    var empty = body.querySelector(".chorus-empty");
    if (empty) empty.remove();
    var row = document.createElement("tr");
    row.dataset.eventId = event.id;
    [String(event.id), event.at.replace("T", " ").slice(0, 19), event.kind, event.actor || "system",
     JSON.stringify(event.data)].forEach(function (text, i) {
      var cell = document.createElement("td");
      var inner = (i === 2 || i === 4) ? document.createElement("code") : i === 1 ? document.createElement("time") : cell;
      inner.textContent = text;
      if (i === 1) { inner.className = "chorus-when"; inner.setAttribute("datetime", event.at); }  // times.js: "3 s ago"
      if (inner !== cell) { if (i === 4) inner.className = "chorus-data"; cell.appendChild(inner); }
      row.appendChild(cell);
    });
    body.insertBefore(row, body.firstChild);
  }

  function appendTurn(event) {
    var table = document.getElementById("chorus-turns");
    if (!table || event.kind !== "turn.created") return;
    var data = event.data;
    if (table.querySelector('[data-turn-id="' + data.id + '"]')) return;
    var row = document.createElement("tr");
    row.dataset.turnId = data.id;
    var link = document.createElement("a");
    link.href = table.dataset.turnUrl.replace("00000000-0000-0000-0000-000000000000", data.id);
    link.textContent = "#" + data.seq;
    var cells = [link, data.trigger, null, "", "", ""];
    cells.forEach(function (content, i) {
      var cell = document.createElement("td");
      if (i === 2) {
        var badge = document.createElement("span");
        badge.className = "chorus-badge chorus-" + data.status;
        badge.dataset.liveId = data.id;
        badge.dataset.liveField = "status";
        badge.textContent = data.status;
        cell.appendChild(badge);
      } else if (content instanceof Node) { cell.appendChild(content); } else { cell.textContent = content; }
      row.appendChild(cell);
    });
    var body = table.tBodies[0];
    body.insertBefore(row, body.firstChild);
  }

  // The run page's task map and evidence grow (new tasks, attempts, member nodes): re-read them.
  var refreshTimer = null;
  var GROWING = ["task.created", "attempt.created", "node.added", "attempt.outcome", "turn.output"];
  // A turn flagged or cleared stalled: the turn page's stall panel and a changelist filtered on
  // "stalled" are re-read too (docs/alerts.md).
  var STALL = ["turn.stalled", "turn.unstalled"];
  function refreshSections(event) {
    var stall = STALL.indexOf(event.kind) >= 0 && (document.getElementById("chorus-stall") ||
      (document.getElementById("changelist-form") && /[?&]stalled=/.test(location.search)));
    if (!stall && (GROWING.indexOf(event.kind) < 0 || !document.getElementById("chorus-task-map"))) return;
    if (event.kind === "turn.output" && event.data.type !== "tool") return;
    clearTimeout(refreshTimer);
    refreshTimer = setTimeout(function () {
      fetch(location.href, {credentials: "same-origin"}).then(function (r) { return r.text(); }).then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        ["chorus-task-map", "chorus-evidence", "chorus-stall", "changelist-form"].forEach(function (id) {
          var now = document.getElementById(id), next = fresh.getElementById(id);
          if (now && next) now.innerHTML = next.innerHTML;
        });
      });
    }, 300);
  }

  // Parts of a detail page marked data-live-refresh (turn rows with their times, the transcript,
  // the actions offered, a task's links) are re-read from the server when an event of the page's
  // own object arrives: what they show follows the state without the page building it in JS.
  // At most one read at a time and one per 700 ms; a burst of events costs one read after it.
  var marked = document.querySelectorAll("[data-live-refresh]");
  var markedTimer = null, markedBusy = false, markedAgain = false;
  function refreshMarked(event) {
    if (!marked.length || event.stream === "dashboard") return;
    if (event.kind === "turn.output" && event.data.type !== "tool") return;  // streamed text: no state change
    if (markedBusy) { markedAgain = true; return; }
    clearTimeout(markedTimer);
    markedTimer = setTimeout(function () {
      markedBusy = true;
      fetch(location.href, {credentials: "same-origin"}).then(function (r) { return r.text(); }).then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        document.querySelectorAll("[data-live-refresh]").forEach(function (now) {
          var next = fresh.getElementById(now.id);
          if (next && now.innerHTML !== next.innerHTML) now.innerHTML = next.innerHTML;
          else if (!next) now.replaceChildren();  // no longer offered (e.g. Interrupt after the stop)
        });
        document.dispatchEvent(new CustomEvent("chorus:refreshed"));
      }).finally(function () {
        markedBusy = false;
        if (markedAgain) { markedAgain = false; refreshMarked(event); }
      });
    }, 700);
  }

  function connect() {
    var scheme = location.protocol === "https:" ? "wss://" : "ws://";
    var socket = new WebSocket(scheme + location.host + "/ws/live/");
    socket.onopen = function () {
      // The backoff is reset only once a stream is really followed ("subscribed"): a socket that
      // opens and is closed at once (close code 4503: the portal's channel layer is down) keeps
      // backing off instead of reconnecting every 500 ms.
      setIndicator("live", "on");
      streams.forEach(function (stream) {
        var message = {type: "subscribe", stream: stream};
        if (cursors[stream] !== undefined) message.after = cursors[stream];
        socket.send(JSON.stringify(message));
      });
    };
    socket.onmessage = function (frame) {
      var message = JSON.parse(frame.data);
      if (message.type === "subscribed") {
        delay = 500;
        if (message.cursor !== null && cursors[message.stream] === undefined) cursors[message.stream] = message.cursor;
      } else if (message.type === "event" || message.type === "events") {
        // "events": several of one stream at once (agent output is sent a few times a second).
        (message.type === "event" ? [message.event] : message.events).forEach(function (event) {
          if (streams.indexOf(event.stream) >= 0) cursors[event.stream] = event.id;
          updateBadges(event);
          appendTimeline(event);
          appendTurn(event);
          refreshSections(event);
          refreshMarked(event);
          document.dispatchEvent(new CustomEvent("chorus:event", {detail: event}));
        });
      } else if (message.type === "error") {
        setIndicator("offline", message.code);
      }
    };
    socket.onclose = function (closed) {
      if (closed.code === 4401 || closed.code === 4403) {
        // Signed out, or access revoked (the portal re-checks every few seconds): no retry loop.
        setIndicator("offline", "access ended: reload the page to sign in");
        return;
      }
      setIndicator("offline", "reconnecting");
      setTimeout(connect, delay);
      delay = Math.min(delay * 2, 10000);
    };
  }
  connect();
})();
